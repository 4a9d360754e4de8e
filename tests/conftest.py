# Importing mlx_kvcache first lets it preload a fast system BLAS before MLX loads.
import mlx_kvcache  # noqa: F401
