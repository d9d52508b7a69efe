"""The routed experts: the host bank, the GPU expert cache, the miss split between PCIe
copies and the CPU, the staged offloaded decode, and their statistics.
"""
