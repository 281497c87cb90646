source .whl-tpu/prelude.sh || exit 3
F='^WARNING: All log|^I0000|hugepages|warnings.warn|symbolize|RAW:|SIGTERM|^PC:|^    @'
for v in "nobarrier 4" "barrier 2" "nobarrier 2"; do timeout 60 python3 .whl-tpu/diag2.py $v 2>&1 | grep -Ev "$F" | tee -a $OUT/diag2.log; echo "$v ended at $SECONDS rc ${PIPESTATUS[0]}" | tee -a $OUT/diag2.log; done
