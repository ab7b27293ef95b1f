"""Per-step timeline of plain batched generate vs the speculative batch path (issue 25 diagnosis)."""
import argparse, json, os, statistics, time, sys
import torch
import hf_specdec
from hf_specdec.draft.batch_sized import SizedLockstepDrafter
import hf_specdec.integration.batch as ib
from hf_specdec_tools.models import load_default_pair
from hf_specdec_tools.prompts import humaneval_prompts

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=4)
p.add_argument("--new-tokens", type=int, default=48)
p.add_argument("--repeats", type=int, default=2)
p.add_argument("--config", default="{}")
p.add_argument("--out", default="/tmp/h25/steps.json")
a = p.parse_args()

target, draft, tok = load_default_pair(dtype=torch.bfloat16)
print("prepack", hf_specdec.prepack(target).reason)
draft = hf_specdec.quantize_draft(draft)
tok.padding_side = "left"
batch = tok(humaneval_prompts(a.batch), return_tensors="pt", padding=True)
print("prompt shape", tuple(batch["input_ids"].shape), "pads", (batch["attention_mask"] == 0).sum(1).tolist())

events = []
def wrap(model, name):
    started = {}
    def pre(module, args, kwargs):
        started["t"] = time.perf_counter()
    def post(module, args, kwargs, out):
        ids = kwargs.get("input_ids", args[0] if args else None)
        events.append((name, started["t"], time.perf_counter(), tuple(ids.shape) if ids is not None else None))
    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post, with_kwargs=True)
wrap(target, "target"); wrap(draft, "draft")
orig = SizedLockstepDrafter.propose
holder = {}
def propose(self, ids, prefixes, unpadded=None):
    events.append(("step", time.perf_counter(), None, (len(ids),)))
    holder["d"] = self
    return orig(self, ids, prefixes, unpadded)
SizedLockstepDrafter.propose = propose

def run(spec):
    events.clear()
    kw = dict(max_new_tokens=a.new_tokens, do_sample=False)
    if spec:
        kw.update(assistant_model=draft, speculation="chain", speculation_config=json.loads(a.config),
                  return_dict_in_generate=True)
    t = time.perf_counter(); out = target.generate(**batch, **kw); total = time.perf_counter() - t
    return total, list(events), out, t

def summarize_plain(ev, total):
    fw = [e for e in ev if e[0] == "target"]
    pre = fw[0]; dec = fw[1:]
    gaps = [b[1] - a_[1] for a_, b in zip(dec, dec[1:])]
    return {"total": total, "prefill": pre[2] - pre[1], "steps": len(dec),
            "fwd_med": statistics.median(e[2] - e[1] for e in dec), "step_med": statistics.median(gaps),
            "fwd_sum": sum(e[2] - e[1] for e in dec)}

def summarize_spec(ev, total, t0, out):
    marks = [i for i, e in enumerate(ev) if e[0] == "step"]
    steps = []
    for k, i in enumerate(marks):
        j = marks[k + 1] if k + 1 < len(marks) else len(ev)
        start = ev[i][1]; end = ev[j][1] if j < len(ev) else t0 + total
        inside = ev[i + 1 : j]
        dr = [e for e in inside if e[0] == "draft"]; tg = [e for e in inside if e[0] == "target"]
        steps.append({"rows": ev[i][3][0], "wall": end - start,
                      "draft": [(e[3], round(e[2] - e[1], 4)) for e in dr],
                      "draft_s": sum(e[2] - e[1] for e in dr),
                      "target": [(e[3], round(e[2] - e[1], 4)) for e in tg],
                      "target_s": sum(e[2] - e[1] for e in tg),
                      "propose_to_target": (tg[0][1] - start) if tg else None,
                      "after_target": (end - tg[-1][2]) if tg else None})
    pre = [e for e in ev if e[0] == "target" and ev.index(e) < marks[0]]
    st = out.speculation_stats
    return {"total": total, "prefill": sum(e[2] - e[1] for e in pre), "steps": steps,
            "stats": [s.as_dict() for s in st], "choices": holder["d"].choices,
            "guard": vars(holder["d"].guard).copy()}

run(False); run(True)  # warm
res = {"load": os.getloadavg(), "plain": [], "spec": []}
for r in range(a.repeats):
    total, ev, out, t0 = run(False); res["plain"].append(summarize_plain(ev, total))
    total, ev, out, t0 = run(True); res["spec"].append(summarize_spec(ev, total, t0, out))
    ps, ss = res["plain"][-1], res["spec"][-1]
    print(f"rep {r}: plain {ps['total']:.2f}s steps {ps['steps']} fwd_med {ps['fwd_med']*1e3:.0f}ms "
          f"step_med {ps['step_med']*1e3:.0f}ms prefill {ps['prefill']*1e3:.0f}ms | spec {ss['total']:.2f}s "
          f"steps {len(ss['steps'])} prefill {ss['prefill']*1e3:.0f}ms load {os.getloadavg()[0]:.2f}", flush=True)
res["load_end"] = os.getloadavg()
json.dump(res, open(a.out, "w"), default=str, indent=1)
