"""The host/device plumbing of a prefill, run on a CPU machine with its device branches forced (issue 22.4, 22.5).

``macer.core.transfer.to_host`` packs the prompt's ids, temporal row and mask into one device-to-host copy and unpacks
them; ``to_device`` packs the plan's int64 tables into one upload (``macer.core.transfer.upload``: pinned,
non-blocking).
On CPU tensors both skip the packing, so every CPU model test passes even if the packing scrambles its pieces; here a
tensor subclass that reports another device (``_Remote``) and fake copies make the packing run and be checked piece by
piece against the tensors it was given. ``layout_mask`` (the 4-D mask of a re-packed batch) is checked against a
loop-built oracle, and its no-fully-masked-row guard is checked to fire.
"""

from __future__ import annotations

import pytest
import torch
from macer.core import transfer
from macer.core.transfer import to_device, to_host, upload
from macer.hf.batch import check_no_masked_row, layout_mask

import macer_kernels


class _Remote(torch.Tensor):
    """A CPU tensor that says it lives on another device (``meta``), so the device branches run; ``.cpu()`` returns
    a plain CPU copy and counts the device-to-host copies."""

    copies = 0

    @property
    def device(self) -> torch.device:
        return torch.device("meta")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cpu:
            cls.copies += 1
            with torch._C.DisableTorchFunctionSubclass():
                return args[0].clone()
        return super().__torch_function__(func, types, args, kwargs or {})


def _remote(t: torch.Tensor) -> _Remote:
    return t.clone().as_subclass(_Remote)


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor) if isinstance(t, _Remote) else t


@pytest.mark.parametrize("float_temporal", [True, False], ids=["float-times", "int-times"])
def test_to_host_unpacks_every_piece_in_one_copy(seed, float_temporal):
    """Guards the packing of ``to_host`` (a planted "offset never advances" gave every piece the first tensor's
    values on a GPU while every CPU test passed): ids, temporal row and mask of a prompt (1-D) and of a batch (2-D)
    come back value for value, in one copy, with ids and mask int64 and float times float64."""
    g = torch.Generator().manual_seed(seed)
    for shape in ((37,), (3, 29)):
        ids = torch.randint(0, 150_000, shape, generator=g)
        temporal = torch.randint(-5, 3000, shape, generator=g)
        if float_temporal:
            temporal = temporal + torch.rand(shape, generator=g, dtype=torch.float64)
        mask = (torch.rand(shape, generator=g) > 0.2).long()
        _Remote.copies = 0
        out = to_host(_remote(ids), _remote(temporal), _remote(mask))
        assert _Remote.copies == 1, f"seed={seed} {shape}: {_Remote.copies} copies"
        for got, want, name in zip(out, (ids, temporal, mask), ("ids", "temporal", "mask"), strict=True):
            assert got.device.type == "cpu" and not isinstance(got, _Remote), name
            assert got.dtype == (torch.float64 if want.is_floating_point() else torch.long), name
            assert torch.equal(got.reshape(want.shape), want), f"seed={seed} {shape} {name}"


def test_to_host_keeps_host_tensors_and_none_in_place(seed):
    """Mixed inputs: a CPU tensor is returned as it is (no copy), None stays None, and the remote pieces around them
    still unpack in order."""
    g = torch.Generator().manual_seed(seed)
    ids, mask = torch.randint(0, 1000, (20,), generator=g), torch.ones(20, dtype=torch.long)
    host_times = torch.arange(20.0)
    _Remote.copies = 0
    got_ids, got_none, got_times, got_mask = to_host(_remote(ids), None, host_times, _remote(mask))
    assert _Remote.copies == 1 and got_none is None and got_times is host_times
    assert torch.equal(got_ids, ids) and torch.equal(got_mask, mask), f"seed={seed}"
    _Remote.copies = 0
    assert to_host(None, host_times) == [None, host_times] and _Remote.copies == 0  # nothing remote: no copy


def test_to_device_splits_one_upload_into_the_tables(seed, monkeypatch):
    """Guards the packing of ``to_device`` (the plan's labels, question rows, picks and chunk ids in one upload):
    with a fake upload that keeps the values, each table comes back as its own int64 values (flattened, as the
    callers reshape them), in order, from exactly one upload to the device asked for."""
    g = torch.Generator().manual_seed(seed)
    tables = [torch.randint(0, 3, (41,), generator=g), torch.arange(4) + 30, torch.empty(0, dtype=torch.long),
              torch.randint(-1, 8, (2, 5), generator=g).int(), torch.tensor([[0], [3]])]
    calls = []

    def fake_upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        calls.append((t.clone(), device))
        return _remote(t)

    monkeypatch.setattr(transfer, "upload", fake_upload)
    device = torch.device("meta")
    out = to_device(tables, device)
    assert len(calls) == 1 and calls[0][1] == device
    assert len(out) == len(tables)
    for i, (got, want) in enumerate(zip(out, tables, strict=True)):
        assert got.dtype == torch.long and torch.equal(_plain(got), want.reshape(-1).long()), f"seed={seed} table {i}"
    assert to_device(tables, torch.device("cpu")) is tables and len(calls) == 1  # CPU: no packing, no upload
    assert to_device([], device) == [] and len(calls) == 1


def test_upload_pins_then_copies_without_waiting(monkeypatch):
    """``upload`` to a GPU copies from pinned memory with ``non_blocking=True`` (a pageable copy may synchronise the
    host); pinning and the copy are faked here (no GPU), the values must arrive unchanged. To any other device it is
    one non-blocking copy, and on CPU no copy at all."""
    events = []

    def fake_pin(self):
        events.append(("pin", self.data_ptr()))
        pinned = self.clone()
        events.append(("pinned", pinned.data_ptr()))
        return pinned

    real_to = torch.Tensor.to

    def fake_to(self, *args, **kwargs):
        device = args[0] if args else kwargs.get("device")
        if isinstance(device, torch.device) and device.type == "cuda":
            events.append(("to", self.data_ptr(), device, kwargs.get("non_blocking", False)))
            return _remote(self)
        return real_to(self, *args, **kwargs)

    t = torch.arange(7)
    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    out = upload(t, torch.device("cuda", 0))
    monkeypatch.undo()
    assert [e[0] for e in events] == ["pin", "pinned", "to"], events
    assert events[0][1] == t.data_ptr() and events[2][1] == events[1][1]  # the copy reads the pinned buffer
    assert events[2][2] == torch.device("cuda", 0) and events[2][3] is True
    assert torch.equal(_plain(out), t)
    meta = upload(t, torch.device("meta"))
    assert meta.device.type == "meta" and meta.shape == t.shape and meta.dtype == t.dtype
    assert upload(t, torch.device("cpu")) is t


@pytest.mark.cuda
def test_packing_on_a_gpu(seed):
    """The same round trips on a real GPU: one copy each way, every piece where it belongs."""
    g = torch.Generator().manual_seed(seed)
    ids, mask = torch.randint(0, 1000, (3, 17), generator=g), torch.ones(3, 17, dtype=torch.long)
    times = torch.rand(3, 17, generator=g, dtype=torch.float64) * 100
    got = to_host(ids.cuda(), times.cuda(), mask.cuda())
    for a, b in zip(got, (ids, times, mask), strict=True):
        assert a.device.type == "cpu" and torch.equal(a.reshape(b.shape), b.to(a.dtype))
    tables = [torch.randint(0, 9, (11,), generator=g), torch.arange(6).reshape(2, 3)]
    out = to_device(tables, torch.device("cuda"))
    for a, b in zip(out, tables, strict=True):
        assert a.is_cuda and torch.equal(a.cpu(), b.reshape(-1))
    assert torch.equal(upload(ids, torch.device("cuda")).cpu(), ids)


def _mask_oracle(valid: torch.Tensor, queries: int) -> torch.Tensor:
    """The re-packed batch's mask by its definition, one entry at a time: query row r (of the last ``queries``) may
    see key j iff j <= r and key j is real, or j == r (a padded row sees itself)."""
    b, k = valid.shape
    out = torch.zeros(b, 1, queries, k, dtype=torch.bool)
    for i in range(b):
        for q in range(queries):
            r = k - queries + q
            for j in range(k):
                out[i, 0, q, j] = (j <= r and bool(valid[i, j])) or j == r
    return out


def test_layout_mask_matches_its_definition_and_masks_no_row_fully(seed):
    """Guards issue 22.5: a mask that leaves a padded row seeing no key (planted: the diagonal term dropped) passed
    every CPU test, since PyTorch's CPU SDPA tolerates a fully masked row where flash / GPU SDPA give NaN. The mask
    equals its loop-built definition (boolean and additive) on random validity patterns (left padding, holes, an
    all-padding row) and every query row sees at least one key."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(6):
        b, k = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))
        queries = int(torch.randint(1, k + 1, (1,), generator=g))
        valid = torch.rand(b, k, generator=g) > 0.4
        valid[0] = False  # a row of padding only
        want = _mask_oracle(valid, queries)
        got = layout_mask(valid, queries, torch.float32, boolean=True)
        assert torch.equal(got, want), f"seed={seed} valid={valid.int().tolist()} queries={queries}"
        assert bool(got.any(-1).all())
        additive = layout_mask(valid, queries, torch.float32, boolean=False)
        assert additive.dtype == torch.float32
        assert torch.equal(additive == 0, want) and bool((additive[~want] == torch.finfo(torch.float32).min).all())


def test_a_fully_masked_row_is_refused():
    """The guard itself: a hand-made mask whose row 2 of sample 1 sees nothing raises, naming both."""
    allowed = torch.ones(2, 1, 3, 4, dtype=torch.bool)
    check_no_masked_row(allowed)
    allowed[1, 0, 2] = False
    with pytest.raises(RuntimeError, match=r"leaves query row 2 of sample 1 with no key to attend to"):
        check_no_masked_row(allowed)


def test_the_mask_guard_reads_device_values_only_in_validation_mode():
    """On a device tensor the guard would be a host read per re-pack: it runs only in validation mode. ``meta``
    tensors have no values, so any read raises: without validation the mask builds, with it the read is tried."""
    valid = torch.ones(2, 5, dtype=torch.bool, device="meta")
    mask = layout_mask(valid, 5, torch.float32, boolean=True)
    assert mask.device.type == "meta" and mask.shape == (2, 1, 5, 5)
    with macer_kernels.validation(), pytest.raises((RuntimeError, NotImplementedError)):
        layout_mask(valid, 5, torch.float32, boolean=True)
