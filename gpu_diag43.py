import sys, torch
from treeattn.hf import Session, _graph
from treeattn.hf.presets import build_model
dev = "cuda" if torch.cuda.is_available() else "cpu"
m = build_model("tiny-llama", None, torch.float32, 0)[0].to(dev).eval()
orig_call = _graph.StaticDecode.__call__
for variant in ("pageable_nb", "blocking", "device_copy"):
    def call(self, tok, variant=variant):
        fw, c = self.fw, self.fw.cache
        if c is not self.cache or c.version != self.version or self.ids is None:
            self._reset()
        pos = int(c.seq_lens[0]); c.begin_decode_step()
        span = _graph.span_of(pos + 1, c.slot_limit); c.reserve(span)
        if c.version != self.version:
            self._reset()
        self.ids.copy_(tok.reshape(c.B, 1), non_blocking=True)
        h = torch.tensor([pos, pos + 1])
        if variant == "pageable_nb": self.meta.copy_(h, non_blocking=True)
        elif variant == "blocking": self.meta.copy_(h)
        else: self.meta.copy_(h.to(self.meta.device))
        fw.counters["forwards"] += 1; self.calls += 1
        if span not in self.kept:
            self.kept[span] = self._capture(span)
        g, out = self.kept[span]
        before = c.k[0].clone()
        g.replay()
        torch.cuda.synchronize() if dev == "cuda" else None
        changed = (c.k[0] != before).any(dim=3).any(dim=1).any(dim=0).nonzero().flatten().tolist()
        print(variant, "pos", pos, "meta", self.meta.tolist(), "slots changed", changed, "captures", self.captures, "ptr", self.meta.data_ptr() % 4096, flush=True)
        return out.clone()
    _graph.StaticDecode.__call__ = call
    e, s = Session(m, prefill_chunk=16), Session(m, prefill_chunk=16, cuda_graph=True)
    if dev == "cpu":
        s.fw.static.graphs = True
        torch.cuda.CUDAGraph = None
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, m.config.vocab_size, (2, 30), generator=g)
    for x in (e, s): x.extend(prompt)
    for i in range(4):
        tok = torch.randint(0, m.config.vocab_size, (2, 1), generator=g)
        a, b = e.extend(tok), s.extend(tok)
        print(variant, i, "diff %.2e" % (a - b).abs().max().item(), flush=True)
# which stream Triton launches on while torch captures
from treeattn.ops import _triton_launch as TL
seen = []
orig = TL.Launcher.__call__
def spy(self, grid, key, args):
    if dev == "cuda" and torch.cuda.is_current_stream_capturing() and len(seen) < 2:
        import triton
        d = triton.runtime.driver.active
        seen.append((torch.cuda.current_stream().cuda_stream, d.get_current_stream(d.get_current_device()), key is not None and key in self.compiled))
        print("capturing: torch stream", seen[-1][0], "triton stream", seen[-1][1], "direct", seen[-1][2], flush=True)
    return orig(self, grid, key, args)
TL.Launcher.__call__ = spy
_graph.StaticDecode.__call__ = orig_call
s = Session(m, prefill_chunk=16, cuda_graph=True)
s.extend(torch.randint(0, 500, (1, 40)))
for i in range(2):
    s.extend(torch.randint(0, 500, (1, 1)))
