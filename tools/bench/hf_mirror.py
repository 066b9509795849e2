#!/usr/bin/env python3
"""A loopback HTTP mirror in Hugging Face's layout, `/{repo}/resolve/{revision}/{file}`, for
measuring `mference install --base-url` on a local checkpoint directory: ranged GETs only (206 with
Content-Range; 200 is never sent), and the digests the Hub publishes: `X-Linked-Etag` (SHA-256) for
`.safetensors` files and files of 10 MiB or more (the Hub's LFS files), `ETag` = git blob id
(sha1 of b"blob <len>\\0" + bytes) for the others. Digests are computed once at start.

    python3 tools/bench/hf_mirror.py DIR --repo org/name --revision main --port 8765
"""

import argparse
import hashlib
import http.server
import os
import socketserver
import sys

CHUNK = 4 << 20


def digests(path: str) -> tuple[str, str]:
    sha, size = hashlib.sha256(), os.path.getsize(path)
    git = hashlib.sha1(b"blob %d\0" % size)
    with open(path, "rb") as f:
        while b := f.read(CHUNK):
            sha.update(b)
            git.update(b)
    return sha.hexdigest(), git.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--repo", default="org/name")
    ap.add_argument("--revision", default="main")
    ap.add_argument("--port", type=int, default=8765)
    a = ap.parse_args()
    files = {}
    for name in sorted(os.listdir(a.dir)):
        p = os.path.realpath(os.path.join(a.dir, name))
        if os.path.isfile(p):
            size = os.path.getsize(p)
            sha, git = digests(p)
            lfs = name.endswith(".safetensors") or size >= 10 << 20
            tag = {"X-Linked-Etag": f'"{sha}"', "ETag": f'"{sha}"'} if lfs else {"ETag": f'"{git}"'}
            files[name] = (p, size, tag)
    prefix = f"/{a.repo}/resolve/{a.revision}/"
    print(f"serving {len(files)} files of {a.dir} at http://127.0.0.1:{a.port}{prefix}", flush=True)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            name = self.path[len(prefix):] if self.path.startswith(prefix) else None
            if name not in files:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            path, size, tag = files[name]
            spec = self.headers.get("Range", "")
            if not spec.startswith("bytes="):
                self.send_response(400)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            first, _, last = spec[6:].partition("-")
            first = int(first)
            last = min(int(last) if last else size - 1, size - 1)
            if first >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            n = last - first + 1
            self.send_response(206)
            for k, v in tag.items():
                self.send_header(k, v)
            self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
            self.send_header("Content-Length", str(n))
            self.end_headers()
            with open(path, "rb") as f:
                sent = 0
                while sent < n:
                    k = os.sendfile(self.connection.fileno(), f.fileno(), first + sent, n - sent)
                    if k == 0:
                        break
                    sent += k

    class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
        daemon_threads = True
        allow_reuse_address = True

    Server(("127.0.0.1", a.port), Handler).serve_forever()


if __name__ == "__main__":
    sys.exit(main())
