"""The package's version, at the bottom of the layer table so a rendered sbatch script can name it."""

VERSION = "0.1.0"
