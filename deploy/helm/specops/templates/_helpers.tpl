{{/*
Names, labels and the few values every component derives the same way.
*/}}

{{- define "specops.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-<chart>, or the release name alone when it already contains the chart name. */}}
{{- define "specops.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "specops.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Name of one component's objects: (dict "ctx" $ "component" "serving") */}}
{{- define "specops.componentName" -}}
{{- printf "%s-%s" (include "specops.fullname" .ctx | trunc 50 | trimSuffix "-") .component }}
{{- end }}

{{/* Selector labels of one component: (dict "ctx" $ "component" "serving") */}}
{{- define "specops.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specops.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* All labels of one component's objects: (dict "ctx" $ "component" "serving") */}}
{{- define "specops.labels" -}}
helm.sh/chart: {{ include "specops.chart" .ctx }}
{{ include "specops.selectorLabels" . }}
app.kubernetes.io/part-of: specops
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "specops.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specops.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* A specops image: (dict "ctx" $ "repository" "..." ["tag" "..."]) -> repo:tag[-cuda]; tag: default image.tag, else appVersion */}}
{{- define "specops.image" -}}
{{- $tag := default (default .ctx.Chart.AppVersion .ctx.Values.image.tag) .tag }}
{{- if eq .ctx.Values.image.variant "cuda" }}{{ $tag = printf "%s-cuda" $tag }}{{ end }}
{{- printf "%s:%s" .repository $tag }}
{{- end }}

{{/* The serving pods' image: the serving image, or with serving.engine vllm the serving-vllm one. */}}
{{- define "specops.servingImage" -}}
{{- if eq .Values.serving.engine "vllm" }}
{{- include "specops.image" (dict "ctx" . "repository" .Values.serving.vllm.image.repository "tag" .Values.serving.vllm.image.tag) }}
{{- else }}
{{- include "specops.image" (dict "ctx" . "repository" .Values.image.servingRepository) }}
{{- end }}
{{- end }}

{{/* Startup probes the serving pod may fail: serving.probes' allowance for the model load, plus with
engine vllm as many periods again as serving.vllm.startTimeoutS (the first vLLM server's start). */}}
{{- define "specops.servingStartupThreshold" -}}
{{- $p := .Values.serving.probes }}
{{- $n := int $p.startupFailureThreshold }}
{{- if eq .Values.serving.engine "vllm" }}
{{- $period := int $p.startupPeriodSeconds }}
{{- $n = add $n (div (add (int (ceil .Values.serving.vllm.startTimeoutS)) (sub $period 1)) $period) }}
{{- end }}
{{- $n }}
{{- end }}

{{- define "specops.kafkaClusterName" -}}
{{- printf "%s-kafka" (include "specops.fullname" . | trunc 40 | trimSuffix "-") }}
{{- end }}

{{/* host:port of the Kafka bootstrap: Strimzi's <cluster>-kafka-bootstrap service, or the external one. */}}
{{- define "specops.kafkaBootstrap" -}}
{{- if eq .Values.kafka.mode "strimzi" }}
{{- printf "%s-kafka-bootstrap:%d" (include "specops.kafkaClusterName" .) (int .Values.kafka.strimzi.port) }}
{{- else }}
{{- required "kafka.external.bootstrap is required with kafka.mode external" .Values.kafka.external.bootstrap }}
{{- end }}
{{- end }}

{{- define "specops.streamUrl" -}}
kafka://{{ include "specops.kafkaBootstrap" . }}
{{- end }}

{{- define "specops.registryUri" -}}
{{- if .Values.mlflow.enabled }}
{{- printf "http://%s:%d" (include "specops.componentName" (dict "ctx" . "component" "mlflow")) (int .Values.mlflow.service.port) }}
{{- else }}
{{- required "mlflow.externalUri is required when mlflow.enabled is false" .Values.mlflow.externalUri }}
{{- end }}
{{- end }}

{{/* The chart's Secret of credentials given as values (DB password, S3 keys, API keys). */}}
{{- define "specops.secretName" -}}
{{- include "specops.componentName" (dict "ctx" . "component" "credentials") }}
{{- end }}

{{- define "specops.postgresSecretName" -}}
{{- default (include "specops.secretName" .) .Values.postgresql.external.existingSecret }}
{{- end }}

{{- define "specops.postgresSecretKey" -}}
{{- if .Values.postgresql.external.existingSecret }}{{ .Values.postgresql.external.existingSecretPasswordKey }}{{ else }}postgres-password{{ end }}
{{- end }}

{{/* SQLAlchemy URL without the password: psycopg2 (libpq) reads it from $PGPASSWORD. */}}
{{- define "specops.postgresUri" -}}
{{- $pg := .Values.postgresql.external }}
{{- printf "postgresql+psycopg2://%s@%s:%d/%s" $pg.user $pg.host (int $pg.port) $pg.database }}
{{- end }}

{{- define "specops.pgPasswordEnv" -}}
- name: PGPASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "specops.postgresSecretName" . }}
      key: {{ include "specops.postgresSecretKey" . }}
{{- end }}

{{/* Environment every specops container shares: where the data, stream and registry are. */}}
{{- define "specops.commonEnv" -}}
- name: SPECOPS_DATA_DIR
  value: /data
# the root filesystem is read-only: caches (DeepSpeed, Triton, torch) go to the /tmp emptyDir
- name: HOME
  value: /tmp
# models come from the volume or the registry, never from a hub
- name: HF_HUB_OFFLINE
  value: "1"
- name: SPECOPS_STREAM_URL
  value: {{ include "specops.streamUrl" . | quote }}
- name: SPECOPS_STREAM_NUM_PARTITIONS
  value: {{ .Values.kafka.topics.partitions | int | quote }}
- name: SPECOPS_STREAM_REPLICATION_FACTOR
  value: {{ .Values.kafka.topics.replicas | int | quote }}
- name: SPECOPS_REGISTRY_URI
  value: {{ include "specops.registryUri" . | quote }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The Milvus knowledge-base service's URI: the chart's Milvus Lite Service, or retrieval.milvus.external.uri. */}}
{{- define "specops.milvusUri" -}}
{{- $m := .Values.retrieval.milvus }}
{{- if eq $m.mode "lite" }}
{{- printf "http://%s:%d" (include "specops.componentName" (dict "ctx" . "component" "milvus")) (int $m.lite.port) }}
{{- else if eq $m.mode "external" }}
{{- required "retrieval.milvus.external.uri is required with retrieval.milvus.mode external: the http(s)://host:port of your Milvus" $m.external.uri }}
{{- end }}
{{- end }}

{{/* Where pods find Milvus-backed KBs (retrieval.milvus.mode lite or external; nothing with none):
SPECOPS_MILVUS_URI overrides the URI a KB's manifest records, SPECOPS_MILVUS_TOKEN comes from the external
server's Secret. Placed before specops.commonEnv, so that extraEnv can still override them. */}}
{{- define "specops.milvusEnv" -}}
{{- $m := .Values.retrieval.milvus }}
{{- if ne $m.mode "none" }}
- name: SPECOPS_MILVUS_URI
  value: {{ include "specops.milvusUri" . | quote }}
{{- if and (eq $m.mode "external") $m.external.tokenSecret.name }}
- name: SPECOPS_MILVUS_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $m.external.tokenSecret.name }}
      key: {{ $m.external.tokenSecret.key }}
{{- end }}
{{- end }}
{{- end }}

{{/* The Milvus Lite server's image: retrieval.milvus.lite.image, else the serving image's repository and tag
without the -cuda suffix (Milvus Lite runs on the CPU). */}}
{{- define "specops.milvusLiteImage" -}}
{{- $i := .Values.retrieval.milvus.lite.image }}
{{- printf "%s:%s" (default .Values.image.servingRepository $i.repository) (default (default .Chart.AppVersion .Values.image.tag) $i.tag) }}
{{- end }}

{{/* GPU requests = limits merged into a resources map: (dict "resources" map "gpus" n "ctx" $) */}}
{{- define "specops.resources" -}}
{{- $res := deepCopy (default dict .resources) }}
{{- if gt (int .gpus) 0 }}
{{- $_ := set $res "requests" (merge (dict .ctx.Values.gpuResourceName (int .gpus)) (default dict $res.requests)) }}
{{- $_ := set $res "limits" (merge (dict .ctx.Values.gpuResourceName (int .gpus)) (default dict $res.limits)) }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/*
A flat map as TOML: strings quoted, booleans and numbers bare (whole numbers without ".0",
which Helm's float64 values would otherwise give), lists of scalars inline. Keys are sorted.
*/}}
{{- define "specops.toml" -}}
{{- range $k, $v := . }}
{{ $k }} = {{ include "specops.tomlValue" $v }}
{{- end }}
{{- end }}

{{- define "specops.tomlValue" -}}
{{- if kindIs "string" . }}{{ toJson . }}
{{- else if kindIs "bool" . }}{{ ternary "true" "false" . }}
{{- else if or (kindIs "float64" .) (kindIs "float32" .) }}{{ if eq (float64 .) (floor .) }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- else if kindIs "slice" . }}[{{ range $i, $e := . }}{{ if $i }}, {{ end }}{{ include "specops.tomlValue" $e }}{{ end }}]
{{- else if kindIs "invalid" . }}{{ fail "a TOML value cannot be null" }}
{{- else }}{{ . }}
{{- end }}
{{- end }}

{{/* serve.toml's fields: the values' serving.config, with the chart-owned ones set (engine and vllm_* from
serving.engine and serving.vllm). With engine vllm the GPU is the vLLM servers': the front door stays on the CPU. */}}
{{- define "specops.serveConfig" -}}
{{- $defaults := dict "stream" "default" "registry" "default" }}
{{- $vllm := eq .Values.serving.engine "vllm" }}
{{- if and (eq .Values.image.variant "cuda") (not $vllm) }}{{ $_ := set $defaults "device" "cuda" }}{{ $_ := set $defaults "dtype" "bfloat16" }}{{ end }}
{{- $owned := dict "host" "0.0.0.0" "port" 8000 "model_dir" "/models" "engine" .Values.serving.engine }}
{{- if $vllm }}
{{- $v := .Values.serving.vllm }}
{{- $args := $v.args }}
{{- if eq .Values.image.variant "cuda" }}{{ $args = trim (printf "--gpu-memory-utilization %v %s" $v.gpuMemoryUtilization $v.args) }}{{ end }}
{{- $_ := set $owned "vllm_speculation" $v.speculation }}
{{- $_ := set $owned "vllm_k" (int $v.k) }}
{{- $_ := set $owned "vllm_max_model_len" (int $v.maxModelLen) }}
{{- $_ := set $owned "vllm_kv_cache_gb" (int $v.kvCacheGb) }}
{{- $_ := set $owned "vllm_args" $args }}
{{- $_ := set $owned "vllm_start_timeout_s" $v.startTimeoutS }}
{{- end }}
{{- $cfg := merge $owned (deepCopy .Values.serving.config) $defaults }}
{{- include "specops.toml" $cfg }}
{{- end }}

{{- define "specops.trainerBackend" -}}
{{- if gt (int .Values.trainer.gpus) 1 }}deepspeed{{ else }}torch{{ end }}
{{- end }}

{{/* train.toml's fields: the values' trainer.config, with the chart-owned ones set. */}}
{{- define "specops.trainConfig" -}}
{{- $defaults := dict }}
{{- if eq .Values.image.variant "cuda" }}{{ $_ := set $defaults "device" "cuda" }}{{ end }}
{{- $owned := dict "out" "/data/trainer" "model_dir" "/models" "schedule" true "backend" (include "specops.trainerBackend" .) }}
{{- if eq .Values.trainer.jobstore "postgresql" }}
{{- $pg := .Values.postgresql.external }}
{{- $_ := set $owned "jobstore" (printf "postgresql+psycopg2://%s@%s:%d/%s" $pg.user $pg.host (int $pg.port) $pg.jobstoreDatabase) }}
{{- else }}
{{- $_ := set $owned "jobstore" "sqlite:////data/trainer/schedule.sqlite" }}
{{- end }}
{{- if .Values.trainer.metrics.enabled }}{{ $_ := set $owned "metrics_port" (int .Values.trainer.metrics.port) }}{{ end }}
{{- if gt (int .Values.trainer.gpus) 1 }}{{ $_ := set $owned "zero_stage" (int .Values.trainer.zeroStage) }}{{ end }}
{{- $cfg := merge $owned (deepCopy .Values.trainer.config) $defaults }}
{{- include "specops.toml" $cfg }}
{{- end }}

{{/* Volumes every specops pod mounts: the read-only models and the memory-backed /dev/shm. */}}
{{- define "specops.modelsVolume" -}}
- name: models
  persistentVolumeClaim:
    claimName: {{ .Values.models.existingClaim }}
    readOnly: true
{{- end }}

{{- define "specops.modelsMount" -}}
- name: models
  mountPath: /models
  readOnly: true
  {{- with .Values.models.subPath }}
  subPath: {{ . }}
  {{- end }}
{{- end }}

{{- define "specops.mlflowArtifacts" -}}
{{- $prefix := trimAll "/" .Values.s3.prefix }}
{{- if $prefix }}{{ printf "s3://%s/%s" .Values.s3.bucket $prefix }}{{ else }}{{ printf "s3://%s" .Values.s3.bucket }}{{ end }}
{{- end }}

{{/* PromQL label matchers of one component's metrics: (dict "ctx" $ "component" "serving" "selector" "...") ->
the selector given, else namespace and service, as the targets of the component's ServiceMonitor carry them. */}}
{{- define "specops.promSelector" -}}
{{- default (printf "namespace=%q,service=%q" .ctx.Release.Namespace (include "specops.componentName" .)) .selector }}
{{- end }}

{{/* Checks across values that the schema cannot express; each names the values to change. */}}
{{- define "specops.validate" -}}
{{- $t := .Values.kafka.topics }}
{{- if gt (int $t.minInsyncReplicas) (int $t.replicas) }}
{{- fail (printf "kafka.topics.minInsyncReplicas (%d) is above kafka.topics.replicas (%d): no write could ever be acknowledged" (int $t.minInsyncReplicas) (int $t.replicas)) }}
{{- end }}
{{- if and (eq .Values.kafka.mode "strimzi") (gt (int $t.replicas) (int .Values.kafka.strimzi.replicas)) }}
{{- fail (printf "kafka.topics.replicas (%d) is above kafka.strimzi.replicas (%d brokers)" (int $t.replicas) (int .Values.kafka.strimzi.replicas)) }}
{{- end }}
{{- $a := .Values.serving.autoscaling }}
{{- if and (ne $a.mode "none") (gt (int $a.minReplicas) (int $a.maxReplicas)) }}
{{- fail (printf "serving.autoscaling.minReplicas (%d) is above serving.autoscaling.maxReplicas (%d)" (int $a.minReplicas) (int $a.maxReplicas)) }}
{{- end }}
{{- if and (ne .Values.image.variant "cuda") (or (gt (int .Values.serving.gpus) 0) (gt (int .Values.trainer.gpus) 0)) }}
{{- fail "serving.gpus / trainer.gpus above 0 need image.variant cuda (the cpu images have no CUDA runtime)" }}
{{- end }}
{{- if and .Values.trainer.enabled .Values.trainer.serviceMonitor.enabled (not .Values.trainer.metrics.enabled) }}
{{- fail "trainer.serviceMonitor.enabled needs trainer.metrics.enabled (the trainer serves no /metrics without it)" }}
{{- end }}
{{- if eq .Values.serving.engine "vllm" }}
{{- $c := .Values.serving.config }}
{{- $longest := add (int (default 2048 $c.max_prompt_tokens)) (int (default 1024 $c.max_tokens_limit)) }}
{{- if lt (int .Values.serving.vllm.maxModelLen) (int $longest) }}
{{- fail (printf "serving.vllm.maxModelLen (%d) is below serving.config's max_prompt_tokens + max_tokens_limit (%d): vLLM would refuse the longest requests the API accepts" (int .Values.serving.vllm.maxModelLen) (int $longest)) }}
{{- end }}
{{- end }}
{{- if and .Values.serving.apiKeys.keys .Values.serving.apiKeys.existingSecret }}
{{- fail "set serving.apiKeys.keys or serving.apiKeys.existingSecret, not both" }}
{{- end }}
{{- $mv := .Values.retrieval.milvus }}
{{- if and $mv.kbBuild.enabled (eq $mv.mode "none") }}
{{- fail "retrieval.milvus.kbBuild.enabled needs retrieval.milvus.mode lite or external: the Job builds the knowledge base into that Milvus" }}
{{- end }}
{{- if and $mv.external.tokenSecret.name (ne $mv.mode "external") }}
{{- fail "retrieval.milvus.external.tokenSecret is only used with retrieval.milvus.mode external (Milvus Lite has no authentication)" }}
{{- end }}
{{- end }}
