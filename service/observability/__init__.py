"""What the server tells its operators: Prometheus metrics and their HTTP port (`metrics`,
`metrics_http`), OpenTelemetry traces (`tracing`) and logs (`logs`).

Observers take plain values or the small interfaces defined here; this layer uses the base modules
only, never scheduling, models or a front end.
"""
