"""Holds a CPU wake-up latency limit (PM QoS) until killed.

Usage: python3 hold_cpu_latency.py [MICROSECONDS]   (default 0)

Writes the limit to /dev/cpu_dma_latency and keeps the file open: while it is open, the kernel
keeps every CPU out of the idle states whose exit latency is above the limit; closing it (on
exit) drops the request. Needs root. Prints the cpuidle driver and its states once, so a run's
log says what the limit changed.
"""
import os
import signal
import struct
import sys
import time

limit_us = int(sys.argv[1]) if len(sys.argv) > 1 else 0
base = "/sys/devices/system/cpu"
try:
    driver = open(f"{base}/cpuidle/current_driver").read().strip()
except OSError:
    driver = "none"
states = []
sdir = f"{base}/cpu0/cpuidle"
if os.path.isdir(sdir):
    for s in sorted(os.listdir(sdir)):
        try:
            name = open(f"{sdir}/{s}/name").read().strip()
            lat = open(f"{sdir}/{s}/latency").read().strip()
            states.append(f"{name}({lat}us)")
        except OSError:
            pass
fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
os.write(fd, struct.pack("i", limit_us))
print(f"holding cpu_dma_latency={limit_us}us; cpuidle driver {driver}, states {' '.join(states)}", flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    time.sleep(3600)
