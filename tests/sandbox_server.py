"""An HTTP server the exposure tests start *inside* a sandbox (standard
library only: sandboxes have no network to install from). It answers plain
requests, a response streamed in two parts, and WebSocket echo; given a
certificate and key after the port, it serves all of that over TLS (the
`httpsPorts` tests), and `/scheme` says which it speaks."""

import base64
import hashlib
import http.server
import os
import ssl
import sys
import time

WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
# The test creates this file (through the SDK) once it has read the first
# part of /stream, which proves that part was not held back.
RELEASE_FILE = "/tmp/release-stream"


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path == "/hello":
            body = f"hello from port {self.server.server_port}, host {self.headers['host']}".encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/scheme":
            body = b"https" if isinstance(self.connection, ssl.SSLSocket) else b"http"
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/stream":
            self.send_response(200)
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            self.chunk(b"first\n")
            deadline = time.monotonic() + 60
            while not os.path.exists(RELEASE_FILE) and time.monotonic() < deadline:
                time.sleep(0.01)
            self.chunk(b"second\n")
            self.chunk(b"")
        elif self.path == "/ws" and self.headers.get("upgrade", "").lower() == "websocket":
            self.websocket()
        else:
            self.send_error(404)

    def chunk(self, data: bytes):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def websocket(self):
        accept = base64.b64encode(hashlib.sha1((self.headers["sec-websocket-key"] + WS_GUID).encode()).digest())
        self.send_response(101)
        self.send_header("upgrade", "websocket")
        self.send_header("connection", "Upgrade")
        self.send_header("sec-websocket-accept", accept.decode())
        self.end_headers()
        self.wfile.flush()
        self.close_connection = True
        while True:
            head = self.rfile.read(2)
            if len(head) < 2:
                return
            opcode, length = head[0] & 0x0F, head[1] & 0x7F
            if length == 126:
                length = int.from_bytes(self.rfile.read(2), "big")
            elif length == 127:
                length = int.from_bytes(self.rfile.read(8), "big")
            mask = self.rfile.read(4)  # client frames are always masked
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(length)))
            if opcode == 0x8:  # close: answer it and stop
                self.frame(0x8, data[:2])
                return
            self.frame(0xA if opcode == 0x9 else opcode, data)  # ping → pong, else echo

    def frame(self, opcode: int, data: bytes):
        n = len(data)
        if n < 126:
            size = bytes([n])
        elif n < 1 << 16:
            size = bytes([126]) + n.to_bytes(2, "big")
        else:
            size = bytes([127]) + n.to_bytes(8, "big")
        self.wfile.write(bytes([0x80 | opcode]) + size + data)
        self.wfile.flush()


server = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
if len(sys.argv) == 4:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(sys.argv[2], sys.argv[3])
    server.socket = context.wrap_socket(server.socket, server_side=True)
server.serve_forever()
