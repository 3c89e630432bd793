"""The copy-engine family: copies between engine pools and the pinned arena by DMA.

``staging``: the ring of device slots that kernel copies pass through, a
kernel on one side and a DMA across PCIe on the other. ``path``: copies by
the copy engines alone, no kernel (``DmaPath``), planned as pitched ops
(``plan``), spread over the streams of one direction (``queue``), small pages
staged through a slot by device-to-device ops (``stage``), queued with the
driver by one thread per direction (``hand``).

Imports: kvd_protocol (the driver calls), and CuPy lazily; never the rest
of kvd.cuda. Nothing is re-exported here.
"""
