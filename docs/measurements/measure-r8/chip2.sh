source .whl-tpu/prelude.sh || exit 3
F='^WARNING: All log|^I0000|hugepages|warnings.warn'
P="python3 benchmarks/measure_tpu.py"
S=transformer_block_grad,gptj_parallel_block,gptj_parallel_block_grad,attention,optax_adamw_step,optax_two_branch_step,flax_linen_cnn_grad,flax_nnx_two_heads,moe_4_experts,moe_4_experts_grad,siamese_grad,three_towers,ensemble_same_width,ensemble_widths,inception_block,flax_vae_step,wmt_transformer_step,moe_train_step,slogdet_inv,transformer_train_step,mlp_ensemble_step,two_tower_step
timeout $((570 - SECONDS)) $P --parts suite --only $S --out $OUT/s2 --budget $((500 - SECONDS)) 2>&1 | grep -Ev "$F" | tee -a $OUT/s2.log
echo "done at $SECONDS s" | tee -a $OUT/s2.log
