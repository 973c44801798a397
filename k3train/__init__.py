"""k3train: pretraining Kimi-K3-class hybrid KDA/MLA + latent-MoE models with JAX/Flax."""
