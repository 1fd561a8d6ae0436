from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="megatron-tp-overlap",
    version="0.1.0",
    description="Autotune Transformer Engine tensor-parallel comm/GEMM overlap (userbuffers) for Megatron-LM",
    long_description=Path(__file__).with_name("README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_tp_overlap", "megatron_tp_overlap.*"]),
    package_data={"megatron_tp_overlap": ["app/conf/*.yaml", "app/conf/*/*.yaml", "model_configs/*/*/config.json"]},
    install_requires=[
        "torch>=2.4",
        "PyYAML>=6.0",
        "rich>=13.0",
        "omegaconf>=2.3",
        "hydra-core>=1.3",
        "matplotlib>=3.7",
        "numpy>=1.24",
        "filelock>=3.12",
        "transformers>=4.40",
        "huggingface_hub>=0.23",  # imported directly (offline mode), not only through transformers
    ],
    entry_points={"console_scripts": ["megatron-tp-overlap = megatron_tp_overlap.tools.cli:main"]},
    extras_require={
        "test": ["pytest>=7.4", "pytest-xdist>=3.5", "ruff==0.17.6"],  # -n 2: CI has 2 cores
        # Needs CUDA to build/run; installed on GPU nodes only.
        "te": ["transformer-engine[pytorch]>=2.20", "megatron-core>=0.19"],
    },
)
