"""K raw CURVE DEALERs (idle) with monitors; counts handshake events per socket over time."""
import json, sys, time, zmq, zmq.auth, collections
ep, K, dur, out, keyf, skf = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
pub, sec = zmq.auth.load_certificate(keyf); spub, _ = zmq.auth.load_certificate(skf)
ctx = zmq.Context(io_threads=1); ctx.max_sockets = 3 * K + 100
socks, mons = [], {}
for i in range(K):
    s = ctx.socket(zmq.DEALER); s.linger = 0
    s.curve_publickey, s.curve_secretkey, s.curve_serverkey = pub, sec, spub
    m = s.get_monitor_socket(zmq.EVENT_ALL, addr=f"inproc://m{i}")
    s.connect(ep); socks.append(s); mons[m] = i
p = zmq.Poller()
for m in mons: p.register(m, zmq.POLLIN)
from zmq.utils.monitor import parse_monitor_message
ev = []  # (t, i, event)
t_end = time.time() + dur
while time.time() < t_end:
    for m, _ in p.poll(200):
        while True:
            try: msg = m.recv_multipart(zmq.NOBLOCK)
            except zmq.Again: break
            e = parse_monitor_message(msg)["event"]
            ev.append((time.time(), mons[m], int(e)))
for s in socks: s.disable_monitor(); s.close(0)
for m in mons: m.close(0)
ctx.term()
json.dump(ev, open(out, "w"))
