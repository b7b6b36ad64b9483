"""The pool in the Prometheus text format, from a scheduler.figures.Snapshot (plain data, no ORM).

Each scrape renders a fresh registry holding one collector over one snapshot: the web server's
own process metrics (the default registry) are not mixed in, and nothing is kept between scrapes."""

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from scheduler.ops import figures

# The classic text format generate_latest writes, which every Prometheus version scrapes.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class PoolCollector:
    def __init__(self, snapshot):
        self.snapshot = snapshot

    def collect(self):
        yield from self.node_families()
        yield from self.job_families()
        yield from self.ledger_families()

    def node_families(self):
        s = self.snapshot
        devices = GaugeMetricFamily("e31_node_devices", "Devices a node offers.", labels=["node", "device_type"])
        allocated = GaugeMetricFamily("e31_node_devices_allocated", "Devices of a node held by open allocations.", labels=["node", "device_type"])
        up = GaugeMetricFamily("e31_node_up", "1 if the node's runner is heartbeating, else 0 (silent, lost or stopped).", labels=["node"])
        lost = GaugeMetricFamily("e31_node_lost", "1 if the node was declared lost.", labels=["node"])
        heartbeat = GaugeMetricFamily("e31_node_last_heartbeat_seconds", "When the node's runner last sent a heartbeat (Unix time).", labels=["node"])
        for node in s.nodes:
            status = node.status(s.now, s.node_timeout_seconds)
            devices.add_metric([node.name, node.device_type], node.devices)
            allocated.add_metric([node.name, node.device_type], node.allocated)
            up.add_metric([node.name], 1 if status == figures.UP else 0)
            lost.add_metric([node.name], 1 if status == figures.LOST else 0)
            heartbeat.add_metric([node.name], node.last_heartbeat.timestamp())
        offered, held = figures.pool_totals(s.nodes, s.now, s.node_timeout_seconds)
        utilization = GaugeMetricFamily("e31_pool_utilization_ratio", "Devices allocated over devices offered by the nodes that are up (0 with none).")
        utilization.add_metric([], held / offered if offered else 0.0)
        yield from (devices, allocated, up, lost, heartbeat, utilization)

    def job_families(self):
        s = self.snapshot
        jobs = GaugeMetricFamily("e31_jobs", "Jobs in each state.", labels=["state"])
        for state, count in sorted(s.job_counts.items()):
            jobs.add_metric([state], count)
        queue = GaugeMetricFamily("e31_queue_jobs", "Queued jobs per team.", labels=["team"])
        queue_devices = GaugeMetricFamily("e31_queue_devices", "Devices the queued jobs of a team ask for.", labels=["team"])
        for group in figures.queue_by_team(s.queued):
            queue.add_metric([group.team], len(group.jobs))
            queue_devices.add_metric([group.team], group.gpus)
        oldest = GaugeMetricFamily("e31_queue_oldest_wait_seconds", "How long the longest-waiting queued job has waited.")
        oldest.add_metric([], figures.oldest_wait_seconds(s.queued, s.now))
        stuck = GaugeMetricFamily("e31_stuck_jobs", "Jobs held in a state longer than expected.", labels=["state"])
        counts = {}
        for item in s.stuck:
            counts[item.job.state] = counts.get(item.job.state, 0) + 1
        for state in ("queued", "starting", "running"):
            stuck.add_metric([state], counts.get(state, 0))
        yield from (jobs, queue, queue_devices, oldest, stuck)

    def ledger_families(self):
        s = self.snapshot
        held = CounterMetricFamily(
            "e31_held_device_seconds", "Device-seconds held, ever (running allocations up to their last heartbeat).", labels=["device_type"]
        )
        for device_type, seconds in sorted(s.held_device_seconds.items()):
            held.add_metric([device_type], float(seconds))
        revenue = CounterMetricFamily("e31_revenue", "Amount charged for held compute, ever, before credits.", labels=["currency"])
        revenue.add_metric([s.currency], float(s.charged))
        credited = CounterMetricFamily(
            "e31_credited", "Amount credited for time lost through the network's fault, ever (billed = revenue - credited).", labels=["currency"]
        )
        credited.add_metric([s.currency], float(s.credited))
        yield from (held, revenue, credited)


def exposition(snapshot):
    """The snapshot as Prometheus text (bytes)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PoolCollector(snapshot))
    return generate_latest(registry)
