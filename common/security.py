"""Who may talk to a job's endpoints: private folders, CURVE keys for tcp, and our own socket files.

    python -m common.security keys RUN_DIR      create the job's CURVE keys (the producer does it when missing)

ipc endpoints live in <run_dir>/sockets/, a folder that must belong to the job's user and be closed to
everyone else (0700): connecting to a unix socket needs write access to it, so the folder is the access
control. A tcp endpoint binds loopback unless transport.tcp_host says otherwise, and then CURVE (pyzmq's
zmq.auth) authenticates every connection: the producer holds the server key pair, the consumers the job's
client key pair, and a ZAP authenticator admits only client public keys found in <run_dir>/keys/clients/.
Keys are files of mode 0600 in a 0700 folder. See docs/security.md for what the service trusts.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from common.run_paths import RunPaths

SERVER = "server"
CLIENT = "consumer"


class InsecureEndpoint(RuntimeError):
    """A folder or key file that others could use to reach or impersonate the job; the message says which."""


def check_private_dir(path: Path) -> None:
    """`path` is a real folder owned by this user with no access for group or others."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise InsecureEndpoint(f"{path} does not exist (the run folder's layout is created at start)") from None
    if not stat.S_ISDIR(st.st_mode):
        raise InsecureEndpoint(f"{path} must be a folder, not a {'symlink' if stat.S_ISLNK(st.st_mode) else 'file'}")
    if st.st_uid != os.geteuid():
        raise InsecureEndpoint(
            f"{path} belongs to uid {st.st_uid}, not to this job's user (uid {os.geteuid()}):"
            " another user could reach or replace its endpoints; remove it or use another run_dir"
        )
    if st.st_mode & 0o077:
        raise InsecureEndpoint(
            f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: group and others must have no access (chmod 700 {path})"
        )


def private_dir(path: Path) -> Path:
    """Create `path` (0700) if it is missing, then check it is private (check_private_dir)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private_dir(path)
    return path


def _check_key_file(path: Path) -> None:
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise InsecureEndpoint(f"{path}: a secret key must be a file of this user with mode 0600 (chmod 600 {path})")


# ---------------------------------------------------------------------------------------------- CURVE
def keys_dir(paths: RunPaths) -> Path:
    return paths.root / "keys"


def ensure_curve_keys(paths: RunPaths) -> Path:
    """The server and client key pairs in <run_dir>/keys/ (created once; files 0600, folders 0700)."""
    root = keys_dir(paths)
    clients = root / "clients"
    for d in (root, clients):
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_private_dir(d)
    for folder, name in ((root, SERVER), (clients, CLIENT)):
        if not (folder / f"{name}.key_secret").exists():
            old = os.umask(0o077)  # born 0600: a key is never readable by others, not even for a moment
            try:
                zmq.auth.create_certificates(folder, name)
            finally:
                os.umask(old)
    return root


@dataclass(frozen=True)
class CurveServer:
    public: bytes
    secret: bytes
    clients_dir: Path  # public keys allowed to connect: *.key


@dataclass(frozen=True)
class CurveClient:
    public: bytes
    secret: bytes
    server_public: bytes


def _load_pair(path: Path) -> tuple[bytes, bytes]:
    _check_key_file(path)
    public, secret = zmq.auth.load_certificate(path)
    if not secret:
        raise InsecureEndpoint(f"{path} holds no secret key")
    return public, secret


def server_curve(paths: RunPaths) -> CurveServer:
    root = ensure_curve_keys(paths)
    public, secret = _load_pair(root / f"{SERVER}.key_secret")
    return CurveServer(public, secret, root / "clients")


def client_curve(paths: RunPaths) -> CurveClient:
    """The consumer's keys: its own pair and the server's public key (created by the producer, or copied)."""
    root = keys_dir(paths)
    mine, server = root / "clients" / f"{CLIENT}.key_secret", root / f"{SERVER}.key"
    if not (mine.is_file() and server.is_file()):
        raise InsecureEndpoint(
            f"cannot load this job's CURVE keys: {mine} and {server} are needed; the producer"
            " creates them at start, or run `python -m common.security keys RUN_DIR`"
        )
    check_private_dir(root)
    public, secret = _load_pair(mine)
    server_public, _ = zmq.auth.load_certificate(server)
    return CurveClient(public, secret, server_public)


def serve_curve(sock: zmq.Socket, ctx: zmq.Context, curve: CurveServer) -> ThreadAuthenticator:
    """Make `sock` (not bound yet) a CURVE server that admits only the job's client keys."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(curve.clients_dir))
    sock.curve_secretkey = curve.secret
    sock.curve_publickey = curve.public
    sock.curve_server = True
    return auth


def use_curve(sock: zmq.Socket, curve: CurveClient) -> None:
    """Make `sock` (not connected yet) a CURVE client of the job's server."""
    sock.curve_secretkey = curve.secret
    sock.curve_publickey = curve.public
    sock.curve_serverkey = curve.server_public


# ---------------------------------------------------------------------------------------------- socket files
class IpcFile:
    """The socket file an ipc bind created; libzmq (4.3) leaves it behind at close, so its owner removes it,
    unless a newer process has bound the same path since (another inode)."""

    def __init__(self, endpoint: str):
        self.path = Path(endpoint.removeprefix("ipc://")) if endpoint.startswith("ipc://") else None
        self.inode = os.stat(self.path).st_ino if self.path else None

    def remove(self) -> None:
        if self.path is None:
            return
        try:
            if os.stat(self.path).st_ino == self.inode:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        self.path = None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m common.security")
    sub = ap.add_subparsers(dest="cmd", required=True)
    keys = sub.add_parser("keys", help="create the job's CURVE keys under RUN_DIR/keys/")
    keys.add_argument("run_dir")
    args = ap.parse_args(argv)
    root = ensure_curve_keys(RunPaths(Path(args.run_dir)))
    print(
        f"keys in {root}: server.key(_secret); clients/{CLIENT}.key(_secret): copy keys/server.key and"
        f" keys/clients/{CLIENT}.key_secret to consumers on other hosts (mode 0600)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
