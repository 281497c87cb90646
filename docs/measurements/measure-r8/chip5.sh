export PYTHONPATH=$PWD:$PYTHONPATH TF_CPP_MIN_LOG_LEVEL=3
F='^WARNING: All log|^I0000|hugepages|warnings.warn|symbolize|RAW:|SIGTERM|^PC:|^    @'
for v in "barrier 4" "barrier 8"; do timeout 50 python3 .whl-tpu/diag2.py $v 2>&1 | grep -Ev "$F" | tee -a $OUT/diag5.log; echo "$v ended at $SECONDS rc ${PIPESTATUS[0]}" | tee -a $OUT/diag5.log; done
timeout 60 python3 .whl-tpu/diag.py while_rk4_mlp_to_t1 while_unknown_trips 2>&1 | grep -Ev "$F" | tee -a $OUT/diag5.log
