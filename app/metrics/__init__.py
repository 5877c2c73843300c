"""Prometheus for the stats the library parts push: the catalog, the sink, the HTTP exporter, the dashboard."""
