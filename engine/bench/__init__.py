"""`moelab bench`: the bandwidth profile's measurement, the decode benchmark and a coding
agent's session replayed."""
