"""Run a jakiro app with uvicorn (and jakiro serve's transport limits) on a free loopback port in a
background thread."""

import threading
import time

import uvicorn


class ServerThread:
    def __init__(self, app, **limits):
        from jakiro.serve.transport import server_config
        config = server_config(app, "127.0.0.1", 0, "warning", lifespan="on", **limits)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)
