"""The decode loop of a cascade generate call: the call's owner (``session``), the one loop (``whole_step``) on its
step runner (``graphs``), token choice on the device or the host (``device_select``, ``host_select``), block
bookkeeping on the device (``device_blocks``), and the step's speed-ups (``fused_linears``, ``fused_ops``,
``regional``)."""
