"""Pair the `a` drafters of two compare.py runs over the same prompts and seeds (the layer diagnostic:
two EAGLE-3 heads measured in separate runs against the same `b`): per set and temperature, both taus
and the paired difference with compare.py's 90% bootstrap interval.

    .venv/bin/python docs/measured/eagle3-vs-eagle1/pair_runs.py docs/measured/eagle3-vs-eagle1/tau_e3_upper.json \
        docs/measured/eagle3-vs-eagle1/tau_e3_ttt5.json
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from compare import paired_interval  # noqa: E402


def main() -> None:
    x, y = (json.loads(Path(p).read_text()) for p in sys.argv[1:3])
    for key in x["summary"]:
        name, temp = key.rsplit("_T", 1)
        pick = lambda d: {r["prompt"]: r["tau"] for r in d["rows"] if r["drafter"] == "a" and r["set"] == name and r["T"] == float(temp)}  # noqa: E731
        a, b = pick(x), pick(y)
        assert a.keys() == b.keys(), key
        diffs = [a[i] - b[i] for i in sorted(a)]
        lo, hi = paired_interval(diffs)
        print(f"{key}: {x['a']} {sum(a.values()) / len(a):.2f}, {y['a']} {sum(b.values()) / len(b):.2f}, "
              f"difference {sum(diffs) / len(diffs):+.2f} ({lo:+.2f}, {hi:+.2f}), {len(diffs)} prompts")


if __name__ == "__main__":
    main()
