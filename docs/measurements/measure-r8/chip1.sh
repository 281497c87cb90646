source .whl-tpu/prelude.sh || exit 3
F='^WARNING: All log|^I0000|hugepages|warnings.warn'
P="python3 benchmarks/measure_tpu.py"
W=while_unknown_trips,while_euler_to_t1,while_rk4_mlp_to_t1,while_newton_cube_roots
timeout 170 $P --parts loops --only $W --out $OUT/w --budget 110 2>&1 | grep -Ev "$F" | tee $OUT/w.log
for i in 1 2; do timeout 60 $P --parts loops --only $W --out $OUT/w2-$i --second 2>&1 | grep -Ev "$F" | tee $OUT/w2-$i.log; done
S=lstm_grad,bigru,bilstm_grad,equinox_mlp_gru,seed_002_two_scans,seed_002_identical_scans,tiny_scan,expm_pair,seed_000_bidirectional_matmul
echo "suite part at $SECONDS s" | tee -a $OUT/s1.log
timeout $((565 - SECONDS)) $P --parts suite --only $S --out $OUT/s1 --budget $((480 - SECONDS)) 2>&1 | grep -Ev "$F" | tee -a $OUT/s1.log
echo "done at $SECONDS s" | tee -a $OUT/s1.log
