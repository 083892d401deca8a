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


def deal(d, until: int | None = None) -> dict[bytes, list[int]]:
    """Make batches until none can be made now (or `until` is reached): which peer got which seqs."""
    got: dict[bytes, list[int]] = {}
    while (seq := d.next_seq()) is not None and (until is None or seq < until):
        for m in d.recipients(seq):
            got.setdefault(m.peer, []).append(seq)
    return got


def reattach(d, peer, drafter, replica, pid, resume, unreleased):
    """The same process says HELLO again (it holds the ring), its old session held `unreleased`."""
    m = d.join(peer, drafter, replica, pid, resume, reattached=True, unreleased=unreleased)
    assert d.attach(peer, m.epoch) is m
    return m


def test_a_replica_reattaching_behind_its_running_group_gets_what_its_session_lost():
    """The scaleout stall: r1 stalled, dropped the batches it had not released, and said HELLO at its resume
    seq while r0 kept the group going; only r1's unreleased seqs are made again (r0's are not repeated)."""
    d = Delivery(["a"], 12)
    attach(d, b"r0", "a", 0)
    attach(d, b"r1", "a", 1)
    got = deal(d, until=8)
    assert got == {b"r0": [0, 2, 4, 6], b"r1": [1, 3, 5, 7]}
    reattach(d, b"r1", "a", 1, pid=1, resume=5, unreleased=[5, 7])  # it trained 1 and 3
    assert d.groups["a"].replay == {5, 7} and not d.finished()
    again = deal(d)
    assert sorted(s for seqs in again.values() for s in seqs) == [5, 7, 8, 9, 10, 11]  # replays first, once
    assert d.finished()


def test_a_group_that_ended_while_its_replicas_stalled_is_reopened_for_their_lost_batches():
    """Both replicas fenced after the last batch was dealt (seqs 79/80 vs the group's 85 in the suite): their
    orphans keep the group open (the producer must not end the job), and each same process gets its own back."""
    d = Delivery(["a"], 6)
    attach(d, b"r0", "a", 0)
    attach(d, b"r1", "a", 1)
    deal(d)
    assert d.finished()
    d.leave(b"r0", unreleased=[4])  # fenced: held seq 4 unreleased
    d.leave(b"r1", unreleased=[3, 5])
    assert not d.finished() and d.next_seq() is None and d.waiting_for() == ["a"]
    reattach(d, b"r1", "a", 1, pid=1, resume=3, unreleased=[])
    assert d.groups["a"].cursor == 6 and d.groups["a"].replay == {3, 5}  # no rewind to 3: 4 is not r1's
    assert deal(d) == {b"r1": [3, 5]}
    assert not d.finished()  # r0's seq 4 is still out
    reattach(d, b"r0", "a", 0, pid=1, resume=4, unreleased=[])
    assert [s for seqs in deal(d).values() for s in seqs] == [4]  # to either replica: they share the stream
    assert d.finished()


def test_a_late_release_from_a_fenced_session_is_no_orphan_and_a_new_process_reforms_from_its_checkpoint():
    d = Delivery(["a"], 10)
    m = attach(d, b"r0", "a", 0)
    deal(d, until=4)
    d.leave(b"r0", unreleased=[2, 3])
    d.released_late(m.epoch, [2])  # it had kept 2 (its RELEASE was on the wire when it was fenced)
    reattach(d, b"r0", "a", 0, pid=1, resume=3, unreleased=[])
    assert d.groups["a"].replay == {3}
    d.leave(b"r0", unreleased=[3])
    new = d.join(b"r0", "a", 0, pid=2, resume_seq=1)  # a restarted process (no ring yet): its checkpoint rules
    assert d.attach(b"r0", new.epoch) is new and new.formed
    assert d.groups["a"].cursor == 1 and not d.groups["a"].replay and not d.groups["a"].orphans


def test_a_member_told_the_stream_ended_is_sent_no_more_batches():
    d = Delivery(["a"], 4)
    attach(d, b"r0", "a", 0)
    attach(d, b"r1", "a", 1)
    deal(d)
    d.by_peer[b"r0"].told_end = True
    d.leave(b"r1", unreleased=[3])
    reattach(d, b"r1", "a", 1, pid=1, resume=3, unreleased=[])
    assert deal(d) == {b"r1": [3]}
