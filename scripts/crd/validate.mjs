// Validate custom resources against the schemas of their CRDs, as published in the
// @kubernetes-models packages (generated from the operators' Go API types).
// Usage: node validate.mjs FILE.json   (a JSON array of objects; prints one line per finding)
import { readFileSync } from "node:fs";
import { PodMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor";
import { PrometheusRule } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule";
import { AnalysisTemplate } from "@kubernetes-models/argo-rollouts/argoproj.io/v1alpha1/AnalysisTemplate";

const models = {
  "monitoring.coreos.com/v1 PodMonitor": PodMonitor,
  "monitoring.coreos.com/v1 PrometheusRule": PrometheusRule,
  "argoproj.io/v1alpha1 AnalysisTemplate": AnalysisTemplate,
};
let failed = 0;
for (const doc of JSON.parse(readFileSync(process.argv[2], "utf8"))) {
  const key = `${doc.apiVersion} ${doc.kind}`;
  const Model = models[key];
  const where = `${key} ${doc.metadata?.name}`;
  if (!Model) { console.log(`${where}: no schema here`); failed++; continue; }
  try {
    new Model(doc).validate();
    console.log(`${where}: ok`);
  } catch (err) {
    console.log(`${where}: ${err.message}`);
    failed++;
  }
}
process.exit(failed ? 1 : 0);
