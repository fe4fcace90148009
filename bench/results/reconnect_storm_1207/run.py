"""Orchestrate: broker (tcp CURVE frontend, ipc backend) + echo worker + load procs + bad client; kill & restart."""
import json, os, signal, subprocess, sys, time, glob, threading, collections
A = "/tmp/audit_storm/audit"; PY = "/work/main/.venv/bin/python"
N = int(sys.argv[1]); P = int(sys.argv[2]); SIG = sys.argv[3]; DUR = float(sys.argv[4]); TKILL = float(sys.argv[5])
tag = f"{SIG}_{N}_{os.environ.get('RAW','0')}"
OUT = f"{A}/out_{tag}"; os.makedirs(OUT, exist_ok=True)
PORT = 27555; HP = 27580
rt = f"{A}/rt"; os.makedirs(rt, mode=0o700, exist_ok=True)
env = dict(os.environ, PYTHONPATH="/tmp/audit_storm", XDG_RUNTIME_DIR=rt, SKEY=f"{A}/keys/server.key")
K = f"{A}/keys"
bcmd = [PY, "-m", "broker", "--frontend", f"tcp://127.0.0.1:{PORT}", "--curve-secret", f"{K}/server.key_secret",
        "--client-keys", f"{K}/clients", "--http", f"127.0.0.1:{HP}"]
procs = []
def start_broker(i):
    f = open(f"{OUT}/broker{i}.log", "w")
    p = subprocess.Popen(bcmd, env=env, stdout=f, stderr=subprocess.STDOUT); procs.append(p); return p
b = start_broker(0)
time.sleep(2)
w = subprocess.Popen([PY, "-m", "gpu_worker", "--model", "echo", "--no-warmup"], env=env,
                     stdout=open(f"{OUT}/worker.log", "w"), stderr=subprocess.STDOUT); procs.append(w)
time.sleep(3)
loads = []
for k in range(P):
    loads.append(subprocess.Popen([PY, f"{A}/load.py", f"tcp://127.0.0.1:{PORT}", str(N // P), str(DUR), f"{OUT}/load{k}.jsonl",
                                   f"{K}/c/good.key_secret"], env=env, stdout=open(f"{OUT}/load{k}.log", "w"), stderr=subprocess.STDOUT))
bad = subprocess.Popen([PY, f"{A}/load.py", f"tcp://127.0.0.1:{PORT}", "1", str(DUR), f"{OUT}/bad.jsonl", f"{K}/c/bad.key_secret"],
                       env=env, stdout=open(f"{OUT}/bad.log", "w"), stderr=subprocess.STDOUT)
RAW=int(os.environ.get("RAW","0")); RP=int(os.environ.get("RAWP","1"))
for k in range(RP if RAW else 0):
    loads.append(subprocess.Popen([PY, f"{A}/rawidle.py", f"tcp://127.0.0.1:{PORT}", str(RAW//RP), str(DUR), f"{OUT}/raw{k}.json",
        f"{K}/c/good.key_secret", f"{K}/server.key"], env=env, stdout=open(f"{OUT}/raw{k}.log", "w"), stderr=subprocess.STDOUT))
procs += loads + [bad]
t0 = time.time()
samples = []; events = {}
cur = {"b": b}
stop = False
def sampler():
    hz = os.sysconf("SC_CLK_TCK"); last = {}
    while not stop:
        p = cur["b"]; t = time.time() - t0
        try:
            st = open(f"/proc/{p.pid}/stat").read().split(")")[1].split()
            cpu = (int(st[11]) + int(st[12])) / hz
            rss = int(open(f"/proc/{p.pid}/statm").read().split()[1]) * 4096 / 2**20
            fds = len(os.listdir(f"/proc/{p.pid}/fd"))
            thr = os.listdir(f"/proc/{p.pid}/task")
            tcpu = {}
            for tid in thr:
                try:
                    s = open(f"/proc/{p.pid}/task/{tid}/stat").read(); nm = s.split("(")[1].split(")")[0]
                    x = s.split(")")[1].split(); tcpu[nm] = tcpu.get(nm, 0) + (int(x[11]) + int(x[12])) / hz
                except Exception: pass
        except Exception:
            cpu = rss = fds = None; tcpu = {}
        try:
            est = subprocess.run(["ss", "-Htn", "state", "established", f"( sport = :{PORT} )"], capture_output=True, text=True, timeout=5).stdout
            nest = len(est.splitlines()); ports = [l.split()[-1] for l in est.splitlines()]
        except Exception: nest = None; ports = []
        samples.append(dict(t=round(t, 2), pid=p.pid, cpu=cpu, rss=rss, fds=fds, est=nest, tcpu=tcpu, ports=ports))
        time.sleep(0.5)
th = threading.Thread(target=sampler, daemon=True); th.start()
time.sleep(TKILL)
events["kill"] = time.time()
b.send_signal(signal.SIGKILL if SIG == "kill" else signal.SIGTERM)
try: b.wait(timeout=20)
except subprocess.TimeoutExpired: b.kill(); b.wait(5)
events["exited"] = time.time(); events["exit_rc"] = b.returncode
b2 = start_broker(1); cur["b"] = b2
events["restart"] = time.time()
for p in loads + [bad]:
    try: p.wait(timeout=DUR + 120)
    except subprocess.TimeoutExpired: p.kill(); events.setdefault("load_killed", 0); events["load_killed"] += 1
stop = True; th.join(5)
for p in (w, b2):
    p.send_signal(signal.SIGINT)
    try: p.wait(timeout=15)
    except subprocess.TimeoutExpired: p.kill(); p.wait(5)
events["t0"] = t0
json.dump(dict(events=events, samples=samples), open(f"{OUT}/run.json", "w"))
print("done", OUT, events)
