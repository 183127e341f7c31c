"""tfdist: distribution strategies for Keras 3 on TensorFlow 2.21."""

from setuptools import find_packages
from setuptools import setup

# The user guide's build (mkdocs.yml); tests/docs_test.py runs it, so the tests need it too.
# Built and tested with MkDocs 1.6 and Material 9, whose notice says MkDocs 2 will not run it.
DOCS = ["mkdocs>=1.6,<2", "mkdocs-material>=9.5,<10", "mkdocstrings[python]>=1.0",
        "mkdocstrings-python>=2.0"]

setup(
    name="tfdist",
    version="0.1.0",
    description="Parameter-server, soft-sync, async and compressed distribution strategies "
                "for Keras 3 on TensorFlow",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tfdist", "tfdist.*"]),
    python_requires=">=3.10",
    install_requires=[
        "keras>=3.15,<3.16",
        "numpy>=1.26",
        "absl-py>=2.1",
        "pyyaml>=5.1",  # the Kubernetes manifests tfdist-launch writes
    ],
    extras_require={
        # TensorFlow is an extra so that users pick the wheel that fits their machine.
        "cpu": ["tensorflow-cpu==2.21.0"],
        "gpu": ["tensorflow==2.21.0"],
        "examples": ["scikit-learn>=1.3", "matplotlib>=3.7", "tensorboard>=2.20"],
        "test": ["pytest>=8", "hypothesis>=6", "ruff>=0.6", "scikit-learn>=1.3",
                 "matplotlib>=3.7", "tensorboard>=2.20", "kubernetes-validate>=1.30",
                 "jsonschema>=4.18", *DOCS],
        "docs": DOCS,
    },
    entry_points={"console_scripts": ["tfdist-launch=tfdist.launch.main:run"]},
)
