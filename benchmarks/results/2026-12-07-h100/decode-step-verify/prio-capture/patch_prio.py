"""Measurement-only tree (not for main): capture every graph on a high-priority stream, so that
the step's own kernels (captured at that priority; PyTorch instantiates graphs with
cudaGraphInstantiateFlagUseNodePriority) take SM slots ahead of the side streams' GEMMs
(aux streams, priority 0 = lowest) when both wait.
    python3 patch_prio.py TREE/src   (patches runner.py; the tree measured was 64962e0)"""
import sys

p = f"{sys.argv[1]}/dsv4/runner.py"
s = open(p).read()
old = """        with torch.cuda.graph(graph, pool=pool):
            yield"""
new = """        dev = torch.cuda.current_device()
        high = _HIGH.get(dev)
        if high is None:
            high = _HIGH[dev] = torch.cuda.Stream(priority=-100)  # clamped to the highest
        with torch.cuda.graph(graph, pool=pool, stream=high):
            yield"""
assert s.count(old) == 1
s = s.replace(old, new)
s = s.replace("@contextlib.contextmanager\ndef capture_graph(", "_HIGH: dict = {}\n\n\n@contextlib.contextmanager\ndef capture_graph(", 1)
open(p, "w").write(s)
print("patched", p)
