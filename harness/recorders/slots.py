"""``slots``: the exchange slots of each rank (:mod:`megatron_diloco.megatron_adapter.exchange_slots`) at the first
training step: per slot of ``DILOCO_TEST_SLOTS`` (default: the DP size), its pieces as ``[parameter name, first
element, end]`` (the element range of the flattened parameter) and the bitwise fingerprint of its values; the
parameters' sizes by name, the rank's main-shard elements (``main_numel``)
and the buckets its shards fall in."""

from __future__ import annotations

import os

from .base import Recorder, fingerprint_ints, wrap


class SlotsRecorder(Recorder):
    name = "slots"
    keys = ("slots",)

    def install(self) -> None:
        from megatron.training import training

        from megatron_diloco.megatron_adapter.exchange_slots import main_ranges, slot_pieces, slot_views
        from megatron_diloco.megatron_adapter.optimizer import _main_params, distributed_optimizers

        record = self.record

        @wrap(training, "train_step")
        def train_step(orig, *a, **k):
            if "slots" not in record:
                model, opt = (a[2], a[3]) if len(a) > 3 else (k["model"], k["optimizer"])
                dist_opts = distributed_optimizers(getattr(opt, "inner", opt))
                group = dist_opts[0].buffers[0].data_parallel_group
                count = int(os.environ.get("DILOCO_TEST_SLOTS", group.size()))
                names = {p: n for chunk in model for n, p in chunk.named_parameters()}
                ranges = main_ranges(dist_opts)
                shards = _main_params(dist_opts)
                slots = slot_pieces(ranges, group.rank(), group.size(), count)
                record["slots"] = {
                    "dp": [group.rank(), group.size()], "numel": {n: p.numel() for p, n in names.items()},
                    "main_numel": sum(t.numel() for t in shards),
                    "buckets": len({(r.buffer, r.bucket) for r in ranges}),
                    "pieces": [[[names[ranges[q.main].param], ranges[q.main].param_start + q.lo,
                                 ranges[q.main].param_start + q.hi] for q in pieces]
                               for pieces in slots],
                    "fingerprints": [fingerprint_ints(slot_views(shards, pieces)) for pieces in slots]}
            return orig(*a, **k)
