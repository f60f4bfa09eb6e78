"""`torchrun --nproc_per_node 2 tests/frozen_shard_probe.py OUT.json`: how many bytes of a frozen teacher's decoder
layers
rank 0 holds gathered after `shard_frozen`, after one forward, and inside `gathered_weights` (tests/test_cluster.py)."""
import json, sys
from types import SimpleNamespace
from pathlib import Path
import torch
from torch.distributed.tensor import DTensor
from latent_rl.engine import setup, shard_frozen, gathered_weights, decoder_layers, teardown
from latent_rl.models import load_model

acc = setup(0)
model, tok = load_model(Path(__file__).resolve().parents[1] / "data" / "teacher")
model.eval().requires_grad_(False)
layers = decoder_layers(model)                   # before sharding (FSDP2 renames their classes)
whole = sum(p.numel() * p.element_size() for layer in layers for p in layer.parameters())
shard_frozen(model, SimpleNamespace(strategy="fsdp"), acc)

def gathered() -> int:
    "Bytes of decoder-layer parameters this rank holds whole (FSDP2 swaps a gathered parameter for a plain tensor)."
    return sum(
        p.numel() * p.element_size() for layer in layers for p in layer.parameters() if not isinstance(p, DTensor)
    )

ids = torch.tensor([tok.encode("def f(x):\n    return x + 1\n")])
out = {"whole_bytes": whole, "after_shard": gathered()}
with torch.no_grad(): model(ids)
out["after_forward"] = gathered()
with gathered_weights(model):
    with torch.no_grad():
        model(ids)
        model(ids)
    out["inside_gathered_weights"] = gathered()
out["after_gathered_weights"] = gathered()
if acc.is_main_process: Path(sys.argv[1]).write_text(json.dumps(out))
acc.wait_for_everyone()
teardown()                                       # before interpreter exit (see latent_rl.engine.teardown)
