"""What a Hugging Face stage that runs the model's own forward costs per micro-batch, against the stage
that mirrored each family's forward by hand (``HFStage`` before the model's own forward replaced it).

    python benchmarks/bench_hf_stage.py [--before REV] [--repeats 31] [--inner 10] [--out FILE.json]

The mirrored stage is read from git (``src/unbubble/models/split.py`` at ``--before``, default the
commit before the change; it needs the repository's history) and imported beside the current one.
Both split the same model (same weights) into 2 stages. One micro-batch is the forward of both stages
chained (the first stage's output detached, as a pipeline receives it), the loss (``causal_lm_loss``),
and the backward of both stages; ``--inner`` micro-batches are timed together (a tenth as many,
at least 1, for the small models), the two systems
alternate (which one goes first alternates too) for ``--repeats`` rounds, and each system's median
ms per micro-batch is reported with the ratio new ÷ mirrored (the median of per-round ratios, so
rounds timed close together are compared). One torch thread, as the emulator runs. The machine's
load (``os.getloadavg``) is printed before and after: on a shared machine, compare only the ratio.

Models: tiny Llama and GPT-2 as the tests build them (d = 32, 4 layers, 2 × 12 tokens, a padding
mask) where per-call overhead weighs most, a middle size (d = 128, 4 layers, 2 × 64 tokens) and small ones (d = 256, 4 layers, 4 × 128 tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def mirrored_split(rev: str) -> types.ModuleType:
    """``unbubble.models.split`` as it was at ``rev`` (its ``HFStage`` mirrors each family's forward)."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:src/unbubble/models/split.py"], check=True,
                         capture_output=True, text=True).stdout
    module = types.ModuleType("mirrored_split")
    sys.modules["mirrored_split"] = module  # dataclasses look their module up
    exec(compile(src, f"{rev}:split.py", "exec"), module.__dict__)
    return module


def models():
    import transformers

    def llama(d, layers):
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, hidden_size=d,
            intermediate_size=d * 3 // 2 if d < 64 else 4 * d, vocab_size=64 if d < 64 else 1024,
            max_position_embeddings=128, attn_implementation="sdpa", bos_token_id=0, eos_token_id=0, pad_token_id=0))

    def gpt2(d, layers):
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=layers, n_head=2 if d < 64 else 4, n_embd=d, n_positions=128, vocab_size=64 if d < 64 else 1024,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False, bos_token_id=0,
            eos_token_id=0, attn_implementation="sdpa"))

    return {"tiny llama (d=32, 2x12)": (llama(32, 4), 2, 12), "tiny gpt2 (d=32, 2x12)": (gpt2(32, 4), 2, 12),
            "mid llama (d=128, 2x64)": (llama(128, 4), 2, 64), "mid gpt2 (d=128, 2x64)": (gpt2(128, 4), 2, 64),
            "small llama (d=256, 4x128)": (llama(256, 4), 4, 128), "small gpt2 (d=256, 4x128)": (gpt2(256, 4), 4, 128)}


def micro_batch(stages, x, y, loss_fn) -> None:
    h = stages[0](x)
    sent = {k: v.detach().requires_grad_(v.is_floating_point()) if isinstance(v, torch.Tensor) else v
            for k, v in h.items()}
    loss = loss_fn(stages[1](sent), y)
    loss.backward()
    torch.autograd.backward([h["hidden_states"]], [sent["hidden_states"].grad])


def run(before: str, repeats: int, inner: int) -> dict:
    from unbubble.models import split as own

    warnings.simplefilter("ignore")
    old = mirrored_split(before)
    torch.set_num_threads(1)
    out = {"before": before, "load_before": os.getloadavg(), "repeats": repeats, "inner": inner, "rows": {}}
    for name, (model, b, t) in models().items():
        g = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        ids = torch.randint(0, vocab, (b, t + 1), generator=g)
        mask = torch.ones(b, t, dtype=torch.long)
        mask[0, :3] = 0
        x, y = {"input_ids": ids[:, :-1], "attention_mask": mask}, ids[:, 1:].masked_fill(mask == 0, -100)
        n_inner = inner if b * t < 100 else max(1, inner // 10)
        systems = {"mirrored": old.split_model(model, 2).stages(), "own forward": own.split_model(model, 2).stages()}
        for stages in systems.values():
            micro_batch(stages, x, y, own.causal_lm_loss)  # warm-up
        times: dict[str, list[float]] = {k: [] for k in systems}
        ratios = []
        for r in range(repeats):
            order = list(systems) if r % 2 == 0 else list(systems)[::-1]
            got = {}
            for key in order:
                t0 = time.perf_counter()
                for _ in range(n_inner):
                    micro_batch(systems[key], x, y, own.causal_lm_loss)
                got[key] = (time.perf_counter() - t0) / n_inner * 1e3
                times[key].append(got[key])
            ratios.append(got["own forward"] / got["mirrored"])
        row = {k: statistics.median(v) for k, v in times.items()}
        row["ratio"] = statistics.median(ratios)
        q = statistics.quantiles(ratios, n=4)
        row["ratio_iqr"] = [q[0], q[2]]
        out["rows"][name] = row
        print(f"{name:28s} mirrored {row['mirrored']:.3f} ms  own forward {row['own forward']:.3f} ms  "
              f"ratio {row['ratio']:.3f} (IQR {q[0]:.3f}–{q[2]:.3f})", flush=True)
    out["load_after"] = os.getloadavg()
    print(f"load average before {out['load_before']}, after {out['load_after']}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="6add9b8~1", help="git revision of the mirrored HFStage")
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--inner", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = run(args.before, args.repeats, args.inner)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
