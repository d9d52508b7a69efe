"""`moelab bench`: the bandwidth profile's measurement and the decode benchmark."""
