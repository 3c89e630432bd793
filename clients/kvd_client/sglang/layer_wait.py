"""KvdLayerCounter: SGLang's per-layer load counter over kvd's layer-wise loads.

SGLang calls ``wait_until(layer)`` before a layer's attention for the batch named by
``set_consumer(index)``; a batch is the kvd loads one ``start_layer_wise_loading`` submitted
(``add_batch``). ``wait_until`` orders the caller's work after that layer of each load
(``KvdClient.wait_for_layer``: on a CUDA pool the stream waits, no host round trip).
``finish(index)`` says whether each load landed in full. Never raises into the forward.
"""

from __future__ import annotations


class KvdLayerCounter:
    def __init__(self, client, num_layers: int):
        self.client = client
        self.num_layers = num_layers
        self.producer_index = -1
        self.consumer_index = -1
        self._batches: dict[int, list] = {}  # index -> [(transfer or None, tokens asked)]

    def add_batch(self, loads: list[tuple[object, int]]) -> int:
        """A new batch of (transfer, tokens asked); its index."""
        self.producer_index += 1
        self._batches[self.producer_index] = loads
        return self.producer_index

    def set_consumer(self, index: int) -> None:
        self.consumer_index = index

    def wait_until(self, layer: int) -> None:
        for transfer, _ in self._batches.get(self.consumer_index, ()):
            if transfer is not None:  # None: never submitted, nothing to wait for
                self.client.wait_for_layer(layer, transfer)

    def finish(self, index: int) -> bool:
        """Wait for every load of batch ``index`` (fenced: kvd writes its pages no more);
        True when each landed every token asked."""
        loads = self._batches.pop(index, [])
        landed = True
        for transfer, asked in loads:
            if transfer is None:
                landed = False
                continue
            transfer.wait()
            landed = landed and transfer.ok and transfer.tokens >= asked
        return landed

    def pending(self) -> list:
        """Every transfer of every batch not finished yet."""
        return [t for loads in self._batches.values() for t, _ in loads if t is not None]

    def reset(self) -> None:
        for transfer in self.pending():
            transfer.wait()
        self._batches.clear()
        self.producer_index = self.consumer_index = -1
