"""Agent harness: executions of environment tasks through the proxy, with compaction,
sub-agents, retries, timeouts and partial-credit scoring in confined workspaces."""
