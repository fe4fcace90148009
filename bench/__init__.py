"""The latency harness: load generation (closed and open loop), HDR histograms, peers run side
by side, reports and plots; `python -m bench` (docs/bench.md).  It sits above every other
package and may import any of them; nothing imports it.  Performance is asserted here, in
measured runs, never in unit tests.
"""
