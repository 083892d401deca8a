"""The consumer's copy-out (consumer/copy_out.py, issue 19 item 4): two buffer sets used in turn, host fields
in host memory; on CUDA its own copy streams, the training stream never synchronised by the host, and a set
overwritten only after the training stream gave up its previous batch."""

import pytest
import torch

from consumer.copy_out import BufferSets, CopyOut
from tests.conftest import requires_cuda


def views(tokens: int, width: int = 3, fill: float = 0.0, device: str = "cpu") -> dict[str, torch.Tensor]:
    return {
        "hidden": torch.full((tokens, width), fill, device=device),
        "input_ids": torch.full((tokens,), int(fill), dtype=torch.int64, device=device),
        "cu_seqlens": torch.tensor([0, tokens], dtype=torch.int32, device=device),
    }


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_two_sets_alternate_and_a_set_is_reused_two_batches_later():
    sets = BufferSets(2, torch.device("cpu"), min_rows=8, pin_host=False)
    got = [sets.buffers_for(sets.next_set(), views(5))[0] for _ in range(3)]
    assert sets.turn == 0
    assert storage(got[0]["hidden"]) != storage(got[1]["hidden"])  # batch n+1 never lands on batch n
    assert storage(got[2]["hidden"]) == storage(got[0]["hidden"])  # batch n+2 reuses batch n's set
    assert got[0]["hidden"].shape == (5, 3) and sets.sets[0].tensors["hidden"].shape == (8, 3)  # min_rows
    assert got[0]["cu_seqlens"].device.type == "cpu" and got[0]["cu_seqlens"].shape == (2,)


def test_a_larger_batch_grows_its_set_and_a_new_width_reallocates():
    sets = BufferSets(1, torch.device("cpu"), min_rows=4, pin_host=False)
    small, allocated = sets.buffers_for(sets.next_set(), views(4))
    assert allocated
    large, allocated = sets.buffers_for(sets.next_set(), views(9))
    assert allocated and large["hidden"].shape == (9, 3) and storage(large["hidden"]) != storage(small["hidden"])
    again, allocated = sets.buffers_for(sets.next_set(), views(6))
    assert not allocated and storage(again["hidden"]) == storage(large["hidden"])  # fits: no new allocation
    wide, allocated = sets.buffers_for(sets.next_set(), views(6, width=5))
    assert allocated and wide["hidden"].shape == (6, 5)


def test_cpu_copy_out_copies_values_and_reads_the_tag():
    copier = CopyOut(torch.device("cpu"), torch.device("cpu"), min_rows=4)
    assert len(copier.sets.sets) == 1 and copier.streams == []
    src = views(3, fill=7.0)
    out, tag = copier.copy(src, torch.tensor([42]))
    assert tag == 42 and torch.equal(out["hidden"], src["hidden"]) and torch.equal(out["input_ids"], src["input_ids"])
    src["hidden"].fill_(1.0)  # the slot is rewritten after the release: the copy is the consumer's
    assert float(out["hidden"][0, 0]) == 7.0
    assert copier.copy(views(2), None)[1] is None


@requires_cuda
@pytest.mark.cuda
def test_cuda_copy_never_waits_for_the_training_stream():
    dev = torch.device("cuda", torch.cuda.current_device())
    copier = CopyOut(dev, dev, min_rows=16)
    src, tag_src = views(16, fill=3.0, device=str(dev)), torch.tensor([5], device=dev)
    for _ in copier.sets.sets:  # both sets allocated (device and pinned host memory) before the timed part
        copier.copy(src, tag_src)
    torch.cuda.synchronize(dev)  # the slot is complete before its BATCH message, as the producer's event ensures
    torch.cuda._sleep(500_000_000)  # the training stream (this thread's current one) is busy
    out, tag = copier.copy(src, tag_src)
    assert tag == 5
    assert not torch.cuda.current_stream(dev).query(), "copy() waited for the training stream"
    assert torch.equal(out["cu_seqlens"], torch.tensor([0, 16], dtype=torch.int32))  # host field, complete now
    torch.cuda.synchronize(dev)
    assert torch.equal(out["hidden"].cpu(), src["hidden"].cpu())


@requires_cuda
@pytest.mark.cuda
def test_cuda_set_is_overwritten_only_after_the_training_stream_gave_up_its_batch():
    """Batch 0's set is batch 2's: the copy of batch 2 must wait for the work the training stream queued on
    batch 0 before batch 1 was asked for (here: a sleep, then a clone of batch 0's features)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    copier = CopyOut(dev, dev, min_rows=16)
    slots = [views(16, fill=float(n + 1), device=str(dev)) for n in range(3)]
    torch.cuda.synchronize(dev)  # the slots are complete before their BATCH messages
    first, _ = copier.copy(slots[0], None)
    torch.cuda._sleep(500_000_000)  # a long step on batch 0...
    seen = first["hidden"].clone()  # ...that reads batch 0 at its end
    second, _ = copier.copy(slots[1], None)
    third, _ = copier.copy(slots[2], None)
    torch.cuda.synchronize(dev)
    assert storage(third["hidden"]) == storage(first["hidden"]) != storage(second["hidden"])
    assert float(seen.min()) == float(seen.max()) == 1.0, "batch 2 overwrote batch 0 under its step"
    assert float(third["hidden"][0, 0]) == 3.0 and float(second["hidden"][0, 0]) == 2.0


@requires_cuda
@pytest.mark.cuda
def test_cuda_copy_waits_for_its_copy_streams_without_spinning_a_core():
    """Batch 2 lands in batch 0's set, so its copy waits (on the GPU) for the step queued on batch 0: the host
    waits on the copy event meanwhile, a blocking-sync one, so the wait costs a fraction of a core."""
    import time

    dev = torch.device("cuda", torch.cuda.current_device())
    copier = CopyOut(dev, dev, min_rows=16)
    slots = [views(16, fill=float(n + 1), device=str(dev)) for n in range(3)]
    for _ in copier.sets.sets:  # both sets allocated first: an allocation waits for the training stream too
        copier.copy(slots[0], None)
    torch.cuda.synchronize(dev)
    copier.copy(slots[0], None)
    torch.cuda._sleep(1_000_000_000)  # a long step on batch 0 (about half a second)
    copier.copy(slots[1], None)
    cpu, wall = time.process_time(), time.perf_counter()
    copier.copy(slots[2], None)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert wall > 0.1, f"the copy did not wait for the step ({wall:.3f} s)"
    assert cpu < 0.2 * wall, f"the host burnt {cpu:.3f} s of CPU in a {wall:.3f} s wait"
