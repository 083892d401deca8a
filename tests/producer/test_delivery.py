from producer.delivery import Delivery


def attach(d, peer, drafter, replica=0, resume=0):
    m = d.join(peer, drafter, replica, pid=1, resume_seq=resume)
    assert d.attach(peer, m.epoch) is m
    return m


def test_every_group_gets_every_batch_round_robin_within_a_group():
    d = Delivery(["a", "b"], total_batches=6)
    attach(d, b"a0", "a")
    attach(d, b"b0", "b", 0)
    attach(d, b"b1", "b", 1)
    got = []
    while (seq := d.next_seq()) is not None:
        got.append((seq, sorted(m.peer for m in d.recipients(seq))))
    assert [s for s, _ in got] == list(range(6))
    assert [p for _, p in got] == [[b"a0", b"b0"], [b"a0", b"b1"]] * 3
    assert d.finished()


def test_next_seq_after_is_what_next_seq_gives_once_the_batch_went_out():
    """The producer makes batch n+1 while n's forward runs: next_seq_after(n) must be next_seq() after
    recipients(n), with a group replaying behind the others, strides of 2, and groups ending."""
    d = Delivery(["a", "b"], 40, stride=2, offset=1)
    attach(d, b"a0", "a", resume=1)
    attach(d, b"b0", "b", resume=1)
    for _ in range(6):
        d.recipients(d.next_seq())
    d.leave(b"b0")
    attach(d, b"b0", "b", resume=5)  # b replays from seq 5; a waits at 13
    seen = []
    while (seq := d.next_seq()) is not None:
        ahead = d.next_seq_after(seq)
        d.recipients(seq)
        assert ahead == d.next_seq(), seq
        seen.append(seq)
    assert seen == [5, 7, 9, 11, *range(13, 40, 2)] and d.finished()


def test_missing_group_blocks_or_is_skipped():
    block = Delivery(["a", "b"], 4, "block")
    attach(block, b"a0", "a")
    assert block.next_seq() is None and block.waiting_for() == ["b"]
    skip = Delivery(["a", "b"], 4, "skip")
    attach(skip, b"a0", "a")
    assert skip.next_seq() == 0 and [m.peer for m in skip.recipients(0)] == [b"a0"]


def test_regrouping_from_an_older_checkpoint_replays_and_others_wait():
    d = Delivery(["a", "b"], 100)
    attach(d, b"a0", "a")
    attach(d, b"b0", "b")
    for seq in range(10):
        assert d.next_seq() == seq
        d.recipients(seq)
    d.leave(b"b0")  # b crashes; its checkpoint covers seqs < 4
    attach(d, b"b0", "b", resume=4)
    assert d.next_seq() == 4
    assert [m.peer for m in d.recipients(4)] == [b"b0"]  # a is past 4: it does not get it again
    for seq in range(5, 10):
        assert d.next_seq() == seq
        assert [m.peer for m in d.recipients(seq)] == [b"b0"]
    assert d.next_seq() == 10 and len(d.recipients(10)) == 2


def test_member_joining_a_running_group_does_not_rewind_it():
    d = Delivery(["a"], 100)
    attach(d, b"a0", "a", 0)
    for _ in range(5):
        d.recipients(d.next_seq())
    attach(d, b"a1", "a", 1, resume=0)
    assert d.next_seq() == 5


def test_stale_epoch_attach_and_unknown_drafter():
    d = Delivery(["a"], 10)
    old = d.join(b"a0", "a", 0, 1, 0)
    new = d.join(b"a0", "a", 0, 2, 0)
    assert d.attach(b"a0", old.epoch) is None and d.attach(b"a0", new.epoch) is new
    try:
        d.join(b"x", "nope", 0, 1, 0)
    except KeyError as err:
        assert "no drafter 'nope'" in str(err)
    else:
        raise AssertionError("unknown drafter accepted")
