"""Measurement-only tree (not for main): capture every graph on a high-priority stream, so that
the step's own kernels (captured at that priority; PyTorch instantiates graphs with
cudaGraphInstantiateFlagUseNodePriority) take SM slots ahead of the side streams' GEMMs
(aux streams, priority 0 = lowest) when both wait.

    python3 patch_prio.py TREE/src   (patches runner.py; the tree measured was 64962e0)
"""

import sys
from pathlib import Path

path = Path(sys.argv[1]) / "dsv4" / "runner.py"
text = path.read_text()
old = """        with torch.cuda.graph(graph, pool=pool):
            yield"""
new = """        dev = torch.cuda.current_device()
        high = _HIGH.get(dev)
        if high is None:
            high = _HIGH[dev] = torch.cuda.Stream(priority=-100)  # clamped to the highest
        with torch.cuda.graph(graph, pool=pool, stream=high):
            yield"""
assert text.count(old) == 1
text = text.replace(old, new)
head = "@contextlib.contextmanager\ndef capture_graph("
text = text.replace(head, "_HIGH: dict = {}\n\n\n" + head, 1)
path.write_text(text)
print("patched", path)
