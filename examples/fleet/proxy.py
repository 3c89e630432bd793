"""A round-robin HTTP proxy in front of vLLM OpenAI servers, timing every request per backend.

    python proxy.py --port 8100 --backends http://127.0.0.1:8001,http://127.0.0.1:8002

Each POST (``/v1/completions``, ...) goes to the next backend that is on, in
turn, with no regard to its prompt (no prefix-aware routing), and streams the
answer back as it comes. Per request it keeps the backend, when it started,
the time to its first body bytes (the first token of a streamed answer),
the total time and the HTTP status. A backend that refuses the connection is
marked off and the request tries the next one (nothing was sent yet).
GETs (``/health``, ``/v1/models``) go to the first backend that is on.

Its own routes, for the script that drives it: ``POST /fleet/off/<i>`` and
``/fleet/on/<i>`` take backend ``i`` out of the rotation or put it back;
``GET /fleet/state`` gives each backend's on flag and requests in flight;
``GET /fleet/log?since=<n>`` the request records from the ``n``-th on.
Runs with aiohttp (vLLM's benchmark client needs it, so it is there).
"""

from __future__ import annotations

import argparse
import time

import aiohttp
from aiohttp import web

HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


class Fleet:
    def __init__(self, backends: list[str]):
        self.backends, self.on = backends, [True] * len(backends)
        self.inflight, self.log, self.turn = [0] * len(backends), [], 0
        self.session: aiohttp.ClientSession | None = None

    def next_backend(self) -> int | None:
        for _ in range(len(self.backends)):
            i, self.turn = self.turn, (self.turn + 1) % len(self.backends)
            if self.on[i]:
                return i
        return None


async def forward(request: web.Request) -> web.StreamResponse:
    fleet: Fleet = request.app["fleet"]
    body = await request.read()
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
    for _ in range(len(fleet.backends)):
        i = fleet.next_backend() if request.method == "POST" else fleet.on.index(True) if any(fleet.on) else None
        if i is None:
            break
        try:
            return await relay(request, fleet, i, body, headers)
        except aiohttp.ClientConnectorError:
            fleet.on[i] = False  # down before anything was sent: the next one takes it
    return web.json_response({"error": "no backend is on"}, status=503)


async def relay(request, fleet: Fleet, i: int, body: bytes, headers: dict) -> web.StreamResponse:
    t0, first, status = time.time(), None, 0
    fleet.inflight[i] += 1
    try:
        async with fleet.session.request(request.method, fleet.backends[i] + request.path_qs,
                                         data=body, headers=headers) as up:
            status = up.status
            out = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() not in HOP})
            await out.prepare(request)
            async for data in up.content.iter_any():
                first = first or time.time()
                await out.write(data)
            await out.write_eof()
            return out
    except aiohttp.ClientConnectorError:
        raise
    except (aiohttp.ClientError, ConnectionError):
        status = 599  # cut off midway: the client sees a broken answer
        raise
    finally:
        fleet.inflight[i] -= 1
        if request.method == "POST" and status:
            fleet.log.append({"backend": i, "start": t0, "ttft": (first or time.time()) - t0,
                              "total": time.time() - t0, "status": status})


async def switch(request: web.Request) -> web.Response:
    fleet: Fleet = request.app["fleet"]
    i = int(request.match_info["i"])
    if not 0 <= i < len(fleet.backends):
        return web.json_response({"error": f"no backend {i}"}, status=404)
    fleet.on[i] = request.match_info["how"] == "on"
    return web.json_response({"on": fleet.on})


async def state(request: web.Request) -> web.Response:
    fleet: Fleet = request.app["fleet"]
    return web.json_response({"on": fleet.on, "inflight": fleet.inflight, "logged": len(fleet.log)})


async def log(request: web.Request) -> web.Response:
    since = int(request.query.get("since", "0"))
    return web.json_response(request.app["fleet"].log[since:])


def app(backends: list[str]) -> web.Application:
    a = web.Application(client_max_size=1 << 30)
    a["fleet"] = Fleet(backends)

    async def session(a):
        # no connection limit: the load generator's concurrency is what limits
        a["fleet"].session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None))
        yield
        await a["fleet"].session.close()

    a.cleanup_ctx.append(session)
    a.router.add_post("/fleet/{how:on|off}/{i:\\d+}", switch)
    a.router.add_get("/fleet/state", state)
    a.router.add_get("/fleet/log", log)
    a.router.add_route("*", "/{tail:.*}", forward)
    return a


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--backends", required=True, help="comma-separated base URLs")
    args = ap.parse_args()
    web.run_app(app(args.backends.split(",")), host="127.0.0.1", port=args.port, print=None,
                access_log=None)


if __name__ == "__main__":
    main()
