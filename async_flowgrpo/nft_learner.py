"""The DiffusionNFT learner under the name scripts and tests import (`nft_learner.NFTLearner`); the
algorithm lives in `algorithms/diffusion_nft.py`."""

from async_flowgrpo.algorithms.diffusion_nft import NFTLearner  # noqa: F401
