import sys, torch
sys.path.insert(0, "tests/gpu")
from test_gpu_hf import hf_generate, tiny_cuda
from treeattn.hf import generate, _graph
_graph.QUANTUM = 16
m = tiny_cuda("gemma2")
ids = torch.randint(0, m.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(4)).cuda()
ref = hf_generate(m, ids, new=40)
for g in (False, True):
    out = generate(m, ids, max_new_tokens=40, stop_at_eos=False, cuda_graph=g, prefill_chunk=16)
    print("gemma2 graph" if g else "gemma2 eager", "equal to HF:", torch.equal(out, ref), (out != ref).nonzero()[:2].tolist(), flush=True)
