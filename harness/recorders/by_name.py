"""``by_name``: the exchange by name (:mod:`megatron_diloco.megatron_adapter.by_name`) checked at the first
training step against an independent computation. Every fp32 main-shard element is set to its canonical index,
computed densely from Megatron's sharded state dict (the local block's global multi-index, flattened row-major,
plus its key's offset in key order); a pull must leave the staging buffer equal to its canonical range; then the
staging buffer is set to ``-index - 0.5`` and a push must leave every main-shard element (every copy) equal to
``-its index - 0.5``. The main shards are restored afterwards. Before, ``values``: each chunk's fingerprint as the
weights stand (pulled). ``DILOCO_TEST_CHUNKS``: G (default 8); ``DILOCO_TEST_PIECE``: the elements per peer of one
all-to-all (default the package's)."""

from __future__ import annotations

import math
import os

from .base import Recorder, fingerprint_ints, wrap


class ByNameRecorder(Recorder):
    name = "by_name"
    keys = ("by_name",)

    def install(self) -> None:
        import torch
        from megatron.training import training

        from megatron_diloco.megatron_adapter.by_name import ByName, param_parts
        from megatron_diloco.megatron_adapter.exchange_slots import main_ranges
        from megatron_diloco.megatron_adapter.optimizer import _main_params, distributed_optimizers

        record = self.record

        def dense_index(local, shape, offset) -> torch.Tensor:
            """The global flat index of every element of a local block (row-major), int64, the block's shape."""
            idx = torch.zeros(local, dtype=torch.int64)
            for axis, (n, off, size) in enumerate(zip(local, offset, shape)):
                along = (torch.arange(n, dtype=torch.int64) + off) * math.prod(shape[axis + 1:])
                idx += along.view(*[n if a == axis else 1 for a in range(len(local))])
            return idx

        @wrap(training, "train_step")
        def train_step(orig, *a, **k):
            if "by_name" not in record:
                model, opt = (a[2], a[3]) if len(a) > 3 else (k["model"], k["optimizer"])
                dist_opts = distributed_optimizers(getattr(opt, "inner", opt))
                ranges, shards = main_ranges(dist_opts), _main_params(dist_opts)
                chunks = int(os.environ.get("DILOCO_TEST_CHUNKS", "8"))
                layout = ByName(list(model), ranges, shards, chunks)
                if os.environ.get("DILOCO_TEST_PIECE"):  # (pulls and pushes in several all-to-alls)
                    layout.piece = int(os.environ["DILOCO_TEST_PIECE"])
                layout.pull()  # the weights as they are: each chunk's fingerprint
                values = [fingerprint_ints([c]) for c in layout.chunk_views()]
                names = param_parts(list(model))
                offsets, n = {}, 0
                for key, shape in layout.table:
                    offsets[key], n = n, n + math.prod(shape)
                saved = [s.detach().clone() for s in shards]
                index = []
                for r, s in zip(ranges, shards):  # each parameter's parts (one; two for a fused --swiglu fc1)
                    whole = torch.cat([dense_index(q.local, q.shape, q.offset).view(-1) + offsets[q.key]
                                       for q in names[id(r.param)]])
                    index.append(whole[r.param_start:r.param_start + s.numel()])
                    s.detach().view(-1).copy_(index[-1].to(torch.float32))
                layout.pull()
                want = torch.arange(layout.lo, layout.hi, dtype=torch.float32)
                pulled = bool(torch.equal(layout.staging.cpu(), want))
                layout.staging.copy_(-want - 0.5)
                layout.push()
                pushed = all(torch.equal(s.detach().view(-1).cpu(), -i.to(torch.float32) - 0.5)
                             for s, i in zip(shards, index))
                for s, v in zip(shards, saved):
                    s.detach().copy_(v)
                record["by_name"] = {"numel": n, "table": [[k, list(s)] for k, s in layout.table],
                                     "digest": layout.digest(), "range": [layout.lo, layout.hi],
                                     "chunks": [list(c) for c in layout.chunk_ranges],
                                     "segments": sum(len(x) for x in layout.out), "pulled": pulled, "pushed": pushed,
                                     "main_numel": sum(s.numel() for s in shards), "values": values}
            return orig(*a, **k)
