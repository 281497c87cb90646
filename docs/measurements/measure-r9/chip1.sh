source .whl-tpu/prelude.sh || exit 3
F='^WARNING: All log|^I0000|hugepages|warnings.warn'
P="python3 benchmarks/measure_tpu.py"
W=while_rk4_mlp_to_t1,while_newton_cube_roots,while_euler_to_t1,elementwise_256sq_n1000
timeout 240 $P --parts loops --only $W --out $OUT/w --budget 170 2>&1 | grep -Ev "$F" | tee $OUT/w.log
for i in 1 2 3; do timeout 60 $P --parts loops --only $W --out $OUT/w2-$i --second 2>&1 | grep -Ev "$F" | tee $OUT/w2-$i.log; done
echo "wmt at $SECONDS s" | tee $OUT/wmt.log
timeout 120 $P --parts suite --only wmt_transformer_step --first 5 --out $OUT/wmt 2>&1 | grep -Ev "$F" | tee -a $OUT/wmt.log
L=$((580 - SECONDS)); echo "hmc8 at $SECONDS s, limit $L" | tee $OUT/hmc8.log
timeout $L python3 benchmarks/measure_corpus.py --only blackjax_hmc_8_chains --limit $((L - 10)) --budget $((L - 5)) --out $OUT/hmc8 2>&1 | grep -Ev "$F" | tee -a $OUT/hmc8.log
echo "done at $SECONDS s" | tee -a $OUT/hmc8.log
