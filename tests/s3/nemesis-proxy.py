#!/usr/bin/env python3
"""A fault-injecting TCP proxy between one Condense host and a Garage cluster (tests/s3/nemesis.sh).

    nemesis-proxy.py LISTEN_PORT DIR UPSTREAM_URL...

Listens on 127.0.0.1:LISTEN_PORT and forwards every connection to the first upstream S3
endpoint (http://127.0.0.1:PORT) that accepts it, so a host keeps working while one Garage
node is killed. It speaks plain HTTP/1.1 without pipelining (what object_store sends over
http://): the bytes the server sends after a request line belong to that request's reply.

Faults are rules in DIR/rules, read again whenever the file changes, one per line:

    METHOD REGEX DELAY_MS COUNT [KILL_PID KILL_AFTER_MS]

A request whose method is METHOD (or `*`) and whose request target matches REGEX (Python re,
searched) has its reply held DELAY_MS before the first byte is passed on; if KILL_PID is given,
that process is sent SIGKILL KILL_AFTER_MS after the reply was passed on. A rule applies COUNT
times (-1: until the file changes). Each hit is appended to DIR/log as
`EPOCH_SECONDS hit METHOD TARGET DELAY_MS` (and `kill PID` when it killed), so a test can wait
for the moment a request is being held.

The proxy never parses bodies and never changes a byte; it is a test tool, not a product part.
"""
import os
import re
import signal
import socket
import sys
import threading
import time

REQUEST = re.compile(rb"^(GET|PUT|HEAD|DELETE|POST) (\S+) HTTP/1\.[01]\r\n")


class Rules:
    def __init__(self, directory):
        self.path = os.path.join(directory, "rules")
        self.log_path = os.path.join(directory, "log")
        self.lock = threading.Lock()
        self.stamp = None
        self.rules = []

    def _reload(self):
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = None
        if stamp == self.stamp:
            return
        self.stamp = stamp
        self.rules = []
        if stamp is None:
            return
        with open(self.path) as f:
            for line in f:
                parts = line.split()
                if len(parts) < 4 or line.startswith("#"):
                    continue
                try:
                    rule = {
                        "method": parts[0],
                        "re": re.compile(parts[1]),
                        "delay": int(parts[2]) / 1000.0,
                        "count": int(parts[3]),
                        "kill": int(parts[4]) if len(parts) > 4 else None,
                        "kill_after": int(parts[5]) / 1000.0 if len(parts) > 5 else 0.0,
                    }
                except (ValueError, re.error) as e:
                    print("nemesis-proxy: bad rule %r: %s" % (line, e), file=sys.stderr)
                    continue
                self.rules.append(rule)

    def match(self, method, target):
        with self.lock:
            self._reload()
            for rule in self.rules:
                if rule["count"] == 0:
                    continue
                if rule["method"] not in ("*", method):
                    continue
                if not rule["re"].search(target):
                    continue
                if rule["count"] > 0:
                    rule["count"] -= 1
                self.log("hit %s %s %d" % (method, target, int(rule["delay"] * 1000)))
                return rule
        return None

    def log(self, text):
        with open(self.log_path, "a") as f:
            f.write("%.3f %s\n" % (time.time(), text))


def shut(*socks):
    """Shut both directions of each socket (the other pump then ends too)."""
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def pump_requests(client, upstream, conn, rules):
    """Client to server: note each request's rule for the reply that follows."""
    try:
        while True:
            data = client.recv(65536)
            if not data:
                break
            m = REQUEST.match(data)
            if m:
                rule = rules.match(m.group(1).decode(), m.group(2).decode("latin-1"))
                with conn["lock"]:
                    conn["rule"] = rule
                    conn["fresh"] = True
            upstream.sendall(data)
    except OSError:
        pass
    finally:
        shut(upstream, client)


def pump_replies(upstream, client, conn, rules):
    """Server to client: hold the first bytes of a reply whose request matched a rule."""
    try:
        while True:
            data = upstream.recv(65536)
            if not data:
                break
            with conn["lock"]:
                rule = conn["rule"] if conn["fresh"] else None
                conn["fresh"] = False
            if rule and rule["delay"] > 0:
                time.sleep(rule["delay"])
            client.sendall(data)
            if rule and rule["kill"]:
                if rule["kill_after"] > 0:
                    time.sleep(rule["kill_after"])
                try:
                    os.kill(rule["kill"], signal.SIGKILL)
                    rules.log("kill %d" % rule["kill"])
                except OSError as e:
                    rules.log("kill %d failed: %s" % (rule["kill"], e))
    except OSError:
        pass
    finally:
        shut(upstream, client)


def connect_upstream(upstreams):
    for host, port in upstreams:
        try:
            return socket.create_connection((host, port), timeout=2)
        except OSError:
            continue
    return None


def serve(client, upstreams, rules):
    upstream = connect_upstream(upstreams)
    if upstream is None:
        client.close()
        return
    upstream.settimeout(None)
    for s in (client, upstream):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn = {"lock": threading.Lock(), "rule": None, "fresh": False}
    t = threading.Thread(target=pump_replies, args=(upstream, client, conn, rules), daemon=True)
    t.start()
    pump_requests(client, upstream, conn, rules)
    t.join()
    client.close()
    upstream.close()


def main():
    if len(sys.argv) < 4:
        sys.exit("usage: nemesis-proxy.py LISTEN_PORT DIR UPSTREAM_URL...")
    port, directory = int(sys.argv[1]), sys.argv[2]
    upstreams = []
    for url in sys.argv[3:]:
        m = re.match(r"^http://([^:/]+):(\d+)/?$", url)
        if not m:
            sys.exit("nemesis-proxy: upstream %r is not http://HOST:PORT" % url)
        upstreams.append((m.group(1), int(m.group(2))))
    rules = Rules(directory)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(64)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:
        client, _ = listener.accept()
        threading.Thread(target=serve, args=(client, upstreams, rules), daemon=True).start()


if __name__ == "__main__":
    main()
