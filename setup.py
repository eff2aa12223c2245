from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="shardscope",
    version="0.1.0",
    description="Choose, run and measure DDP / FSDP / DeepSpeed ZeRO strategies with the Hugging Face Trainer.",
    long_description=Path("README.md").read_text(),
    long_description_content_type="text/markdown",
    package_dir={"": "plugin"},
    packages=find_packages("plugin"),
    # data/ holds symlinks to the top-level config folders, so one copy ships in the wheel.
    package_data={"shardscope": ["data/*/*", "data/*/*/*", "model_configs/*/config.json"]},
    python_requires=">=3.10",
    # torch is deliberately not pinned to a build: install the one that fits your machine first.
    install_requires=["torch>=2.4", "transformers>=4.46", "accelerate>=1.0", "pyyaml", "psutil"],
    extras_require={
        "deepspeed": ["deepspeed>=0.15"],
        "peft": ["peft>=0.13"],
        "qlora": ["bitsandbytes>=0.50"],  # QLoRA: its CPU backend quantises and trains 4-bit layers (no CUDA torch pulled)
        "recipes": ["datasets>=2.20", "pillow", "matplotlib"],
        "test": ["pytest>=8", "pytest-xdist>=3.5", "hypothesis", "datasets>=2.20", "pillow", "matplotlib", "tokenizers", "trl==1.16.0", "pyflakes"],
    },
    entry_points={"console_scripts": ["shardscope=shardscope.cli:main"]},
)
