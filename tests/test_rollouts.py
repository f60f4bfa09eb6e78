"""The vLLM weight stream on CPU: FSDP2-sharded parameters (real DTensors over gloo) are gathered one at a time, in
order."""
import os, socket, subprocess, sys
from conftest import ROOT, ONE

SCRIPT = r'''
import os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
sys.path.insert(0, os.environ["ROOT"])
from latent_rl.policy import named_weights, layer_chunks
from transformers import Qwen2Config, AutoModelForCausalLM
dist.init_process_group("gloo")
torch.manual_seed(0)
m = AutoModelForCausalLM.from_config(Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=2))
full = {n: p.detach().clone() for n, p in m.named_parameters()}
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
for mod in list(m.modules()):                        # shard every parameter on dim 0, as FSDP2 does
    for k, p in list(mod.named_parameters(recurse=False)):
        mod.register_parameter(k, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
assert all(isinstance(p, DTensor) for p in m.parameters())
live, peak = [0], [0]
orig = DTensor.full_tensor
def counted(self, *a, **k):
    live[0] += 1; peak[0] = max(peak[0], live[0]); return orig(self, *a, **k)
DTensor.full_tensor = counted
names = []
for name, t in named_weights(m):
    assert not isinstance(t, DTensor) and torch.equal(t, full[name]), name
    names.append(name); live[0] -= 1                 # the consumer drops it before asking for the next
assert names == list(full) and peak[0] == 1, (peak, names[:3])
assert sum(len(c) for c in layer_chunks(named_weights(m))) == len(full)
print("OK", dist.get_rank(), len(names))
dist.barrier()
dist.destroy_process_group()                         # a clean exit: gloo's threads joined before the interpreter ends
'''

def test_named_weights_gathers_fsdp2_shards_one_at_a_time(tmp_path):
    (tmp_path / "s.py").write_text(SCRIPT)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    p = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
            str(tmp_path / "s.py"),
        ],
        env={**os.environ, **ONE, "ROOT": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("OK") == 2, p.stdout
