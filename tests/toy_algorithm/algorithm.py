from sgl_spec.common.algorithm import Algorithm
from sgl_spec.common.chain_worker import ChainDraftWorker


class ToyWorker(ChainDraftWorker):
    name = "TOY_LOOKUP"

    def chain_length(self, settings: int) -> int:
        return settings

    def draft(self, tokens: list[int], max_drafts: int) -> list[int]:
        """What followed the last earlier occurrence of the last token."""
        for i in range(len(tokens) - 2, -1, -1):
            if tokens[i] == tokens[-1]:
                return tokens[i + 1 : i + 1 + max_drafts]
        return []


class ToyLookup(Algorithm):
    name = "TOY_LOOKUP"
    cuda_graph_off_reason = "drafts are looked up on the host"

    def settings(self, config, launch) -> int:
        return config.toy_drafts

    def verify_shape(self, settings: int) -> tuple[int, int]:
        return settings, settings + 1

    def worker_class(self) -> type:
        return ToyWorker


ALGORITHM = ToyLookup()
