"""`python -m tests.support.motoserve [PORT]`: moto's S3 API server (as moto's own
ThreadedMotoServer builds it) in a process of its own on 127.0.0.1. It prints the port it listens
on (PORT, or one the kernel chose) once it does, and logs no request: a test never waits on a
sleep, and no pipe fills up behind it."""

from __future__ import annotations

import sys

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server


class _Quiet(MotoRequestHandler):
    def log_request(self, *args: object, **kwargs: object) -> None:
        pass


def main() -> None:
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    server = make_server("127.0.0.1", port, DomainDispatcherApplication(create_backend_app), True,
                         request_handler=_Quiet)
    print(server.server_address[1], flush=True)
    sys.stdout.close()
    server.serve_forever()


if __name__ == "__main__":
    main()
