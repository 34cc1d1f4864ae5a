"""A/B in one process: drafting with EagleHead.decode as it is against its previous version (e9b4cbe:
the HF RMSNorm modules and HF's rotary embedding per call), interleaved per prompt, answers checked
equal. Run from the repository root: .venv/bin/python docs/measured/drafter-default/ab_lean_decode.py"""
import time, torch, warnings, statistics, sys
warnings.simplefilter("ignore")
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from vlmspec.factory import EngineSpec, build_engine
from vlmspec.engine import GenerationConfig
from vlmspec.data.heldout import heldout
from vlmspec.inputs import encode_messages, user_turn
from vlmspec.draft import eagle as E
torch.set_num_threads(2)
prompts = sys.argv[1] if len(sys.argv) > 1 else "bench"
eng = build_engine(EngineSpec(model="models/smolvlm-toyworld", drafter="assets/smolvlm-toyworld-drafter", device="cpu", dtype="bfloat16", policy="fixed"))
convs = heldout(prompts, 8)
reqs = [encode_messages(eng.target, user_turn(c.prompt, len(c.images)), c.images) for c in convs]
cfg = GenerationConfig(max_new_tokens=96)
@torch.no_grad()
def old(self, token_ids, features, position_ids, attention_mask, cache, direct=None, fuse=None, global_feat=None):
    layer, att, mlp = self.layer, self.layer.self_attn, self.layer.mlp
    lin = self._decode_linears()
    t, f = token_ids[None], features[None]
    emb = self.embed(t); f = f.to(emb.dtype)
    x = lin.fc(torch.cat([self.embed_norm(emb), self.feat_norm(f)], dim=-1))
    n, d, heads, kv = x.shape[1], att.head_dim, self.config.num_attention_heads, self.config.num_key_value_heads
    qkv = lin.qkv(layer.input_layernorm(x)).view(1, n, heads + 2 * kv, d).transpose(1, 2)
    q, k, v = qkv.split([heads, kv, kv], dim=1)
    cos, sin = self.rotary(x, position_ids[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = cache.update(k, v, att.layer_idx)
    a = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=att.scaling, enable_gqa=True)
    x = x + lin.o(a.transpose(1, 2).reshape(1, n, heads * d))
    gate, up = lin.gate_up(layer.post_attention_layernorm(x)).chunk(2, dim=-1)
    return (x + lin.down(mlp.act_fn(gate) * up))[0]
new = E.EagleHead.decode
res = {"new": [], "old": []}
for r in reqs[:2]: eng.generate(r, cfg)
for rep in range(2):
    for i, r in enumerate(reqs):
        order = ("new", "old") if (i + rep) % 2 == 0 else ("old", "new")
        outs = {}
        for name in order:
            E.EagleHead.decode = new if name == "new" else old
            out = eng.generate(r, cfg)
            outs[name] = out.token_ids
            res[name].append((out.timings["draft"], out.stats.num_drafts, sum(out.timings.values()), out.timings.get("verify", 0)))
        assert outs["new"] == outs["old"], "different answers"
for name, v in res.items():
    d = sum(x[0] for x in v); n = sum(x[1] for x in v); tot = sum(x[2] for x in v); ver = sum(x[3] for x in v)
    print(name, "draft s", round(d, 3), "steps", n, "ms/step", round(d / n * 1000, 2), "verify ms/step", round(ver / n * 1000, 2), "total s", round(tot, 3))
ratios = [a[0] / b[0] for a, b in zip(res["new"], res["old"])]
print("per-run draft ratio new/old: median", round(statistics.median(ratios), 3), "min", round(min(ratios), 3), "max", round(max(ratios), 3))
