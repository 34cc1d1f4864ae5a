"""`vlmspec bench load` (#47 item 4): a short concurrency sweep through the real HTTP server on the toy model."""

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
pytest.importorskip("matplotlib")

from vlmspec import assets
from vlmspec.bench.load import _check_answers, markdown, ratios, same_request_p99
from vlmspec.stats import percentile
from vlmspec.cli import main


@pytest.mark.skipif(assets.bundled_target() is None, reason="needs the committed toy model (assets/toyworld-vlm)")
def test_a_short_load_sweep_on_the_toy_runs_every_way_and_changes_no_answer(tmp_path, capsys):
    out = tmp_path / "load"
    code = main(["bench", "load", "--model", "toy", "--concurrency", "1,2", "--requests", "2", "--max-new-tokens", "6",
                 "--prompts", "3", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads((out / "load.json").read_text())
    assert {(lv["way"], lv["clients"]) for lv in report["levels"]} == {(w, c) for w in ("plain", "fixed", "goodput", "baseline") for c in (1, 2)}
    for lv in report["levels"]:
        assert lv["requests"] == max(2, 2 * lv["clients"]) and lv["tokens"] == 6 * lv["requests"]  # ignore_eos: every answer is whole
        assert lv["changed"] == 0 and lv["tokens_per_s"] > 0 and 0 < lv["ttft_p50_s"] <= lv["latency_p99_s"]
        assert lv["mean_batch"] >= 1.0 and (lv["way"] != "baseline" or lv["mean_batch"] == 1.0)  # the baseline serves one at a time
        assert lv["latency_p50_s"] <= lv["latency_p99_s"]
        # while every client was busy: a part of the level, by the server's own token counter
        assert 0 < lv["busy_s"] <= lv["seconds"] and lv["busy_mean_batch"] >= 1.0 and 0 < lv["busy_tokens_per_s"] * lv["busy_s"] <= lv["tokens"] + 1e-6
        if lv["clients"] == 1:  # one client runs out only after its last answer: every token is counted
            assert lv["busy_tokens_per_s"] * lv["busy_s"] == pytest.approx(lv["tokens"])
        # where the engine's time went: prefills and decode steps, within the level's wall time (one engine per server)
        assert 0 < lv["prefill_share"] < 1 and 0 < lv["engine_s"] <= lv["seconds"] and lv["decode_tokens_per_s"] > 0
    assert report["env"]["max_batch"] == [16] and report["env"]["command"].startswith("vlmspec bench load")
    table = (out / "load.md").read_text()
    assert table.startswith("`vlmspec bench load --model toy") and "| goodput | 16 | 2 |" in table and "| baseline | 1 | 1 |" in table
    assert table.split("\n", 2)[2].strip() in printed  # the same table on the console
    assert (out / "load_throughput.png").stat().st_size > 1000 and (out / "load_latency.png").stat().st_size > 1000


def test_answers_are_checked_against_the_lowest_concurrency_and_percentiles():
    levels = [{"series": "plain", "clients": 1, "answers": {0: "a", 1: "b"}}, {"series": "plain", "clients": 4, "answers": {0: "a", 1: "c"}},
              {"series": "fixed", "clients": 4, "answers": {0: "x"}}]
    _check_answers(levels)
    assert [lv["changed"] for lv in levels] == [0, 1, 0]  # negative control: the changed answer is counted
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([1.0, 2.0], 99) == pytest.approx(1.99) and percentile([5.0], 99) == 5.0
    report = {"options": {"max_tokens": 8, "requests": 2}, "levels": [
        {"way": w, "max_batch": b, "series": w, "clients": c, "requests": 2, "tokens_per_s": t, "latency_p50_s": 1.0, "latency_p99_s": 2.0,
         "ttft_p50_s": 0.1, "ttft_p99_s": 0.2, "mean_batch": 1.0, "changed": 0, "busy_tokens_per_s": 2 * t, "busy_mean_batch": 1.5}
        for w, b, c, t in (("plain", 8, 1, 10.0), ("plain", 8, 8, 30.0), ("goodput", 8, 8, 45.0), ("goodput", 16, 8, 90.0))]}
    for lv, decode in zip(report["levels"][1:3], (40.0, 70.0)):  # the 8-client levels say where their engine's time went
        lv.update(prefill_share=0.25, decode_tokens_per_s=decode)
    decode_alone = "goodput / plain at 8 clients, decode steps alone (the engine's seconds without prefills)"
    assert ratios(report) == {"plain: tokens/s at 8 clients / at 1": 3.0, "plain: p99 latency at 8 clients / p50 at 1": 2.0,
                              "goodput / plain at 8 clients": 1.5, "plain: tokens/s at 8 clients / at 1, while all clients were busy": 3.0,
                              "goodput / plain at 8 clients, while all clients were busy": 1.5, decode_alone: 1.75}
    assert "goodput / plain at 8 clients: 1.50x" in markdown(report)  # on the first max_batch only (not 16's 90 tokens/s)
    assert "| goodput | 16 | 8 | 2 | 90.0 |" in markdown(report) and "| 1.0 | 180.0, 1.5 | - | 0/2 |" in markdown(report)
    assert "| 1.0 | 90.0, 1.5 | 25%, 70.0 | 0/2 |" in markdown(report)
    del report["levels"][0]["busy_tokens_per_s"]  # a report written before the busy part was measured: no such figures
    assert "plain: tokens/s at 8 clients / at 1, while all clients were busy" not in ratios(report) and "| 1.0 | - | - | 0/2 |" in markdown(report)


def test_the_engine_s_time_by_phase_is_read_from_the_server_s_counters():
    """Prefill share and decode-step tokens/s from the server's `vlmspec_engine_seconds_total{phase}`,
    summed over label sets (replicas); a server that does not count them gives none (negative control)."""
    from types import SimpleNamespace

    from vlmspec.bench.load import _engine_time, _server_counts

    def server(text):
        return SimpleNamespace(get=lambda url: SimpleNamespace(text=text))

    before = _server_counts(server('vlmspec_engine_seconds_total{phase="prefill"} 1.0\nvlmspec_engine_seconds_total{phase="verify"} 2.0\n'
                                   'vlmspec_generated_tokens_total{mode="plain"} 5.0\n'), "/metrics")
    after = _server_counts(server('vlmspec_engine_seconds_total{phase="prefill",replica="a"} 2.0\n'
                                  'vlmspec_engine_seconds_total{phase="prefill",replica="b"} 1.5\n'
                                  'vlmspec_engine_seconds_total{phase="verify"} 6.0\nvlmspec_engine_seconds_total{phase="draft"} 1.0\n'
                                  '# HELP vlmspec_engine_seconds_total seconds\nvlmspec_generated_tokens_total{mode="plain"} 25.0\n'), "/metrics")
    assert after["engine:prefill"] == 3.5 and after["vlmspec_generated_tokens_total"] == 25.0
    got = _engine_time(before, after, tokens=22, requests=2)  # 2.5 s of prefills, 5 s of steps for 20 tokens
    assert got == {"engine_s": 7.5, "prefill_share": pytest.approx(2.5 / 7.5), "decode_tokens_per_s": 4.0}
    plain_server = _server_counts(server('vlmspec_generated_tokens_total{mode="plain"} 25.0\n'), "/metrics")
    assert _engine_time(plain_server, plain_server, tokens=22, requests=2) == {}


def test_the_tail_is_read_per_request_against_the_same_request_alone():
    """A slow prompt that is as slow alone is no tail; a prompt slowed by the load is (negative control)."""
    alone = {"latencies": {"0": [1.0], "1": [4.0]}}  # keys as JSON writes them
    assert same_request_p99(alone, {"latencies": {0: [2.0, 2.0], 1: [8.0]}}) == pytest.approx(2.0)
    assert same_request_p99(alone, {"latencies": {0: [2.0], 1: [40.0]}}) == pytest.approx(9.92)
    assert same_request_p99(alone, {"latencies": {0: [2.0], 2: [99.0]}}) == 2.0  # a request not run alone is not compared


def test_a_sweep_stopped_part_way_keeps_the_levels_it_measured(tmp_path, monkeypatch):
    """After each level the report so far is written (load.json and load.md, the table saying it
    stopped part way), so a run killed by a time limit leaves its levels; a finished run says
    nothing of the kind (negative control)."""
    import argparse

    from vlmspec.bench import load
    from vlmspec.cli.load import _checkpoint

    def fake_level(endpoint, bodies, clients, requests):
        if clients == 4 and endpoint.way == "plain":  # the second level of 4 clients (the ways are rotated)
            raise KeyboardInterrupt  # the time limit, say
        return {"clients": clients, "requests": requests, "tokens": 8 * requests, "tokens_per_s": 10.0 * clients, "latency_p50_s": 1.0,
                "latency_p99_s": 2.0, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2, "mean_batch": 1.0, "answers": {0: "a"}, "latencies": {0: [1.0]}}

    monkeypatch.setattr(load, "run_level", fake_level)
    monkeypatch.setattr(load, "bodies", lambda model, opts, way: [])
    endpoints = [load.Endpoint("http://x", "m", w, 16) for w in ("plain", "goodput")]
    opts = load.LoadOptions((1, 4), 2, 8, 3, 0)
    args = argparse.Namespace(out=str(tmp_path / "load"), command_line="vlmspec bench load --concurrency 1,4")
    with pytest.raises(KeyboardInterrupt):
        load.sweep(endpoints, opts, progress=False, on_level=_checkpoint(args, {"dtype": "float32"}))
    kept = json.loads((tmp_path / "load" / "load.json").read_text())
    assert [(lv["way"], lv["clients"]) for lv in kept["levels"]] == [("plain", 1), ("goodput", 1), ("goodput", 4)]
    assert kept["planned"] == 4 and kept["env"] == {"dtype": "float32"}
    assert "Stopped part way: 3 of 4 levels measured" in (tmp_path / "load" / "load.md").read_text()
    assert _checkpoint(argparse.Namespace(out=None), {}) is None  # without --out nothing is written

    monkeypatch.setattr(load, "run_level", lambda e, b, clients, requests: fake_level(e, b, clients if clients == 1 else 2, requests))
    done = load.sweep(endpoints, load.LoadOptions((1, 2), 2, 8, 3, 0), progress=False)
    assert len(done["levels"]) == done["planned"] == 4 and "Stopped part way" not in load.markdown(done)
    assert done["options"]["ignore_eos"] is True
    natural = load.sweep(endpoints, load.LoadOptions((1, 2), 2, 8, 3, 0, ignore_eos=False), progress=False)
    assert natural["options"]["ignore_eos"] is False and "ending at the model's end of turn" in load.markdown(natural)


def test_answers_run_past_the_end_of_turn_unless_no_ignore_eos_is_given():
    """By default every request asks for `ignore_eos` (answers of one length); `--no-ignore-eos`
    sends requests whose answers end where the model ends them, and the table says which ran."""
    from vlmspec.bench.load import LoadOptions, bodies
    from vlmspec.cli import build_parser

    assert build_parser().parse_args(["bench", "load"]).ignore_eos is True
    assert build_parser().parse_args(["bench", "load", "--no-ignore-eos"]).ignore_eos is False
    for ignore in (True, False):
        sent = bodies("bench", LoadOptions((1,), 2, 8, 3, 0, ignore_eos=ignore), "goodput")
        assert len(sent) == 3 and all(b["ignore_eos"] is ignore and b["max_tokens"] == 8 for b in sent)
    level = {"way": "plain", "max_batch": 16, "clients": 1, "requests": 2, "tokens_per_s": 9.0, "latency_p50_s": 1.0, "latency_p99_s": 1.0,
             "ttft_p50_s": 0.1, "ttft_p99_s": 0.1, "mean_batch": 1.0, "changed": 0}
    report = {"options": {"concurrency": [1], "requests": 2, "max_tokens": 8}, "levels": [level]}
    assert "8 tokens per request (ignore_eos)" in markdown(report)  # older reports carry no ignore_eos: they ran with it
    report["options"]["ignore_eos"] = False
    assert "8 tokens per request at most, each answer ending at the model's end of turn" in markdown(report)
