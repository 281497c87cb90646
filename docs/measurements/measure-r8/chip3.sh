source .whl-tpu/prelude.sh || exit 3
F='^WARNING: All log|^I0000|hugepages|warnings.warn'
P="python3 benchmarks/measure_tpu.py"
timeout 90 python3 .whl-tpu/diag.py while_newton_cube_roots while_rk4_mlp_to_t1 2>&1 | grep -Ev "$F" | tee $OUT/diag.log
echo "at $SECONDS" | tee -a $OUT/diag.log
timeout 150 $P --parts loops --only while_newton_cube_roots,while_rk4_mlp_to_t1 --out $OUT/w3 --budget 100 2>&1 | grep -Ev "$F" | tee $OUT/w3.log
echo "at $SECONDS" | tee -a $OUT/w3.log
timeout $((540 - SECONDS)) $P --parts suite --only two_tower_step,seed_000_bidirectional_matmul --out $OUT/s3 --budget 100 2>&1 | grep -Ev "$F" | tee $OUT/s3.log
echo "done at $SECONDS" | tee -a $OUT/s3.log
