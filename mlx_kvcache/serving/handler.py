"""mlx-lm's HTTP handler plus ``GET /v1/cache`` (what the prompt cache holds, as JSON) and
``DELETE /v1/cache`` (drop it, in memory and on disk). Every other route is mlx-lm's."""

from __future__ import annotations

import json

from mlx_lm.server import APIHandler


class CacheAPIHandler(APIHandler):
    def _cache(self):
        return getattr(self.response_generator, "prompt_cache", None)

    def _send_json(self, status: int, body) -> None:
        data = json.dumps(body).encode()
        self._set_completion_headers(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _is_cache_route(self) -> bool:
        return self.path.split("?", 1)[0].rstrip("/") == "/v1/cache"

    def do_GET(self):
        if not self._is_cache_route():
            return super().do_GET()
        cache = self._cache()
        if cache is None or not hasattr(cache, "report"):
            return self._send_json(503, {"error": "the prompt cache is not available"})
        self._send_json(200, cache.report())

    def do_DELETE(self):
        if not self._is_cache_route():
            return self._send_json(404, {"error": f"no DELETE route {self.path}"})
        cache = self._cache()
        if cache is None or not hasattr(cache, "clear"):
            return self._send_json(503, {"error": "the prompt cache is not available"})
        cache.clear()
        self._send_json(200, {"cleared": True, **cache.report()})
