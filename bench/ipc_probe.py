"""Can two processes share CUDA memory here? gpu_check's first stage: the slot ring's own path
(common/ring_cuda.py: a dedicated allocation exported by CUDA IPC, rebuilt by torch.multiprocessing's
rebuild_cuda_tensor in another process). A sandbox (gVisor) may not support it; the answer says so plainly.

    python -m bench.ipc_probe            # the probe: one JSON line
    python -m bench.ipc_probe --child    # the other process (reads the handle as JSON on stdin)

The handle travels as JSON (bytes as hex), never pickled. The child checks the bytes the parent wrote and
writes its own into the second half, which the parent then reads back.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NBYTES = 1 << 20
MARK = 0xA5  # what the child writes into the second half


def pattern(n: int):
    import torch

    return torch.arange(n, dtype=torch.int64).remainder(251).to(torch.uint8)  # 251: prime, no power-of-2 alias


def verdict(cuda: bool, cuda_ipc: bool, error: str | None = None) -> dict:
    """The probe's answer in words: whether the ring (and so the pipeline stage) can run here."""
    if not cuda:
        says = "no CUDA: no CUDA device is visible, so CUDA IPC cannot be probed; the ring cannot run here"
    elif cuda_ipc:
        says = (
            "CUDA IPC works here: a 1 MiB block exported by one process was mapped, read and written by another;"
            " the ring can run"
        )
    else:
        says = (
            f"CUDA IPC does not work here ({error}): the ring cannot run; the single-process stages still run,"
            " the pipeline stage and the ring's CUDA tests are skipped"
        )
    return {"cuda": cuda, "cuda_ipc": cuda_ipc, **({"error": error} if error else {}), "says": says}


def probe(timeout_s: float = 60) -> dict:
    """Export a ring-like block, have a child process map it, read it and write into it; the verdict."""
    import torch

    if not torch.cuda.is_available():
        return verdict(False, False, "no CUDA device is visible")
    from common import ring_cuda

    try:
        buf = ring_cuda.allocate(NBYTES, "cuda:0")
        half = NBYTES // 2
        buf[:half].copy_(pattern(half).cuda())
        torch.cuda.synchronize()
        handle = {k: v.hex() if isinstance(v, bytes) else v for k, v in ring_cuda.export(buf).items()}
    except Exception as err:  # an allocation or export refused: the answer, not a crash
        return verdict(True, False, f"export: {type(err).__name__}: {str(err)[:200]}")
    try:
        child = subprocess.run(
            [sys.executable, "-m", "bench.ipc_probe", "--child"],
            cwd=ROOT,
            input=json.dumps({"handle": handle, "nbytes": NBYTES}),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return verdict(True, False, f"the other process gave no answer in {timeout_s:g} s")
    lines = [li for li in child.stdout.splitlines() if li.startswith("{")]
    reply = json.loads(lines[-1]) if lines else {"error": f"exited {child.returncode}: {child.stderr.strip()[-200:]}"}
    if "error" in reply:
        return verdict(True, False, f"the other process: {reply['error']}")
    torch.cuda.synchronize()
    wrote = bool((buf[half:] == MARK).all())
    if not reply.get("read_ok") or not wrote:
        return verdict(
            True, False, f"the shared bytes differ (read by the other: {reply.get('read_ok')}, written back: {wrote})"
        )
    return verdict(True, True)


def child() -> int:
    """Map the handle from stdin, compare the first half with the pattern, write MARK into the second half."""
    try:
        import torch

        from common import ring_cuda

        msg = json.loads(sys.stdin.read())
        types = dict(zip(ring_cuda._IPC_KEYS, ring_cuda._IPC_TYPES, strict=True))
        handle = {k: bytes.fromhex(v) if types.get(k) is bytes else v for k, v in msg["handle"].items()}
        buf = ring_cuda.attach(handle, msg["nbytes"], None)
        half = msg["nbytes"] // 2
        read_ok = bool(torch.equal(buf[:half].cpu(), pattern(half)))
        buf[half:].fill_(MARK)
        torch.cuda.synchronize()
        print(json.dumps({"read_ok": read_ok}))
    except Exception as err:  # reported to the parent as the reason
        print(json.dumps({"error": f"{type(err).__name__}: {str(err)[:200]}"}))
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--child"]:
        return child()
    print(json.dumps(probe()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
