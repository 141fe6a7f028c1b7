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
- name: SPECOPS_LOG_FORMAT
  value: {{ .Values.logFormat | quote }}
- name: SPECOPS_ACCESS_LOG
  value: {{ ternary "1" "0" .Values.accessLog | quote }}
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
{{- $_ := set $owned "shutdown_timeout_s" (include "specops.servingShutdownTimeout" . | int) }}
{{- if $vllm }}
{{- $v := .Values.serving.vllm }}
{{- $args := $v.args }}
{{- if eq .Values.image.variant "cuda" }}{{ $args = trim (printf "--gpu-memory-utilization %v %s" $v.gpuMemoryUtilization $v.args) }}{{ end }}
{{- $_ := set $owned "vllm_speculation" $v.speculation }}
{{- $_ := set $owned "vllm_k" (int $v.k) }}
{{- $_ := set $owned "vllm_copy_k" (int $v.copyK) }}
{{- $_ := set $owned "vllm_standby" (int $v.standby) }}
{{- $_ := set $owned "vllm_draft_vocab" $v.draftVocab }}
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

{{/* The models PVC: models.existingClaim, else the one the chart creates (templates/models-pvc.yaml). */}}
{{- define "specops.modelsClaim" -}}
{{- default (include "specops.componentName" (dict "ctx" . "component" "models")) .Values.models.existingClaim }}
{{- end }}

{{/* Environment of the pods that mount the models: the router's MiniLM embedder is where `specops bootstrap`
puts it, embedder/ beside target/ and draft/ (the images' default names /models/default/embedder, compose's layout).
Placed before specops.commonEnv, so that extraEnv can still override it. */}}
{{- define "specops.modelsEnv" -}}
- name: SPECOPS_EMBEDDER_DIR
  value: /models/embedder
{{- end }}

{{/* The read-only models volume of serving, the trainer and the kb-build Job. */}}
{{- define "specops.modelsVolume" -}}
- name: models
  persistentVolumeClaim:
    claimName: {{ include "specops.modelsClaim" . }}
    readOnly: true
{{- end }}

{{/* With models.fill: an init container that waits until the fill Job is done with <subPath>: for its completion
marker <subPath>/ready.json (core/model_layout.py), which both modes write last, once target/, draft/ and (with
models.fill.embedder) embedder/ are all there and pass the checks serving runs when it loads. A directory replaced
by a forced fill has no marker until its own is written.
It mounts the volume's root, not the subPath: a subPath is bound when a container starts, and the fill replaces
that directory. (dict "ctx" $ "image" "...") */}}
{{- define "specops.waitForModels" -}}
{{- $ctx := .ctx }}
{{- if $ctx.Values.models.fill.enabled }}
- name: wait-for-models
  image: {{ .image | quote }}
  imagePullPolicy: {{ $ctx.Values.image.pullPolicy }}
  args:
    - python
    - -c
    - |
      import os, sys, time
      path, timeout = os.environ["MODELS_READY_FILE"], float(os.environ["WAIT_TIMEOUT_S"])
      deadline = time.monotonic() + timeout
      while not os.path.isfile(path):
          if time.monotonic() >= deadline:
              sys.exit(f"{path} still missing after {timeout:g} s: see the models-fill Job's log")
          print(f"waiting for {path}, the marker the models-fill Job writes once the models are complete", flush=True)
          time.sleep(10)
      print(f"{path} is there", flush=True)
  env:
    - name: MODELS_READY_FILE
      value: {{ printf "/models-volume/%s/ready.json" $ctx.Values.models.subPath | quote }}
    - name: WAIT_TIMEOUT_S
      value: {{ $ctx.Values.models.fill.waitTimeoutSeconds | int | quote }}
  resources:
    requests:
      cpu: 10m
      memory: 32Mi
    limits:
      memory: 128Mi
  securityContext:
    {{- toYaml $ctx.Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: models
      mountPath: /models-volume
      readOnly: true
{{- end }}
{{- end }}

{{/* Scheduling fields of a pod spec from a component's values: priorityClassName, runtimeClassName,
nodeSelector, tolerations, affinity, topologySpreadConstraints (each only when set). */}}
{{- define "specops.podScheduling" -}}
{{- with .priorityClassName }}
priorityClassName: {{ . | quote }}
{{- end }}
{{- with .runtimeClassName }}
runtimeClassName: {{ . | quote }}
{{- end }}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The MLflow server's image: mlflow.image, else the trainer image (mlflow, psycopg2 and boto3 are runtime
dependencies of the package) at image.tag, else the chart's appVersion, without the -cuda suffix. */}}
{{- define "specops.mlflowImage" -}}
{{- $i := .Values.mlflow.image }}
{{- printf "%s:%s" (default .Values.image.trainerRepository $i.repository) (default (default .Chart.AppVersion .Values.image.tag) $i.tag) }}
{{- end }}

{{/* serve.toml's shutdown_timeout_s: what is left of the pod's grace period after the preStop sleep and the margin. */}}
{{- define "specops.servingShutdownTimeout" -}}
{{- $s := .Values.serving }}
{{- sub (sub (int $s.terminationGracePeriodSeconds) (int $s.preStopSleepSeconds)) (int $s.drainMarginSeconds) }}
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
{{- if and (ne .Values.image.variant "cuda") (or (gt (int .Values.serving.gpus) 0) (gt (int .Values.trainer.gpus) 0) (gt (int .Values.models.fill.gpus) 0)) }}
{{- fail "serving.gpus / trainer.gpus / models.fill.gpus above 0 need image.variant cuda (the cpu images have no CUDA runtime)" }}
{{- end }}
{{- if lt (include "specops.servingShutdownTimeout" . | int) 1 }}
{{- fail (printf "serving.terminationGracePeriodSeconds (%d) leaves no time to drain after serving.preStopSleepSeconds (%d) and serving.drainMarginSeconds (%d): raise it" (int .Values.serving.terminationGracePeriodSeconds) (int .Values.serving.preStopSleepSeconds) (int .Values.serving.drainMarginSeconds)) }}
{{- end }}
{{- $fill := .Values.models.fill }}
{{- if and $fill.enabled (not .Values.models.subPath) }}
{{- fail "models.fill.enabled needs models.subPath (e.g. default): the fill renames a complete directory into place, and the volume's root cannot be renamed" }}
{{- end }}
{{- if and $fill.enabled (eq $fill.mode "s3") (not $fill.s3.uri) }}
{{- fail "models.fill.mode s3 needs models.fill.s3.uri: s3://bucket/prefix of a directory holding target/ and draft/" }}
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

{{/* The pod template of the mlflow-db-upgrade Job (its hash names the Job). */}}
{{- define "specops.mlflowDbUpgradePod" -}}
{{- $component := dict "ctx" . "component" "mlflow-db-upgrade" }}
{{- $m := .Values.mlflow }}
metadata:
  labels:
    {{- include "specops.labels" $component | nindent 4 }}
spec:
  restartPolicy: Never
  serviceAccountName: {{ include "specops.serviceAccountName" . }}
  automountServiceAccountToken: {{ .Values.serviceAccount.automountToken }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml .Values.podSecurityContext | nindent 4 }}
  containers:
    - name: db-upgrade
      image: {{ include "specops.mlflowImage" . | quote }}
      imagePullPolicy: {{ $m.image.pullPolicy }}
      # Creates the tracking / registry schema on an empty database, or migrates it to this MLflow's.
      command: ["mlflow", "db", "upgrade", {{ include "specops.postgresUri" . | quote }}]
      env:
        - name: HOME
          value: /tmp
        {{- include "specops.pgPasswordEnv" . | nindent 8 }}
      securityContext:
        {{- toYaml .Values.securityContext | nindent 8 }}
      resources:
        {{- toYaml $m.resources | nindent 8 }}
      volumeMounts:
        - name: tmp
          mountPath: /tmp
        {{- with .Values.jobs.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: tmp
      emptyDir: {}
    {{- with .Values.jobs.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with include "specops.podScheduling" .Values.jobs }}
  {{- . | trim | nindent 2 }}
  {{- end }}
{{- end }}

{{/* The pod template of the models-fill Job (its hash names the Job). The volume's root is mounted read-write at
/models: the fill writes <subPath> there (through a temporary sibling it renames into place). */}}
{{- define "specops.modelsFillPod" -}}
{{- $component := dict "ctx" . "component" "models-fill" }}
{{- $f := .Values.models.fill }}
{{- $out := printf "/models/%s" .Values.models.subPath }}
{{- $s3Secret := "" }}
{{- $s3IdKey := "AWS_ACCESS_KEY_ID" }}
{{- $s3KeyKey := "AWS_SECRET_ACCESS_KEY" }}
{{- if $f.s3.existingSecret }}
{{- $s3Secret = $f.s3.existingSecret }}
{{- else if .Values.s3.existingSecret }}
{{- $s3Secret = .Values.s3.existingSecret }}{{ $s3IdKey = .Values.s3.existingSecretAccessKeyIdKey }}{{ $s3KeyKey = .Values.s3.existingSecretSecretAccessKeyKey }}
{{- else if .Values.s3.accessKeyId }}
{{- $s3Secret = include "specops.secretName" . }}
{{- end }}
metadata:
  labels:
    {{- include "specops.labels" $component | nindent 4 }}
spec:
  restartPolicy: Never
  serviceAccountName: {{ include "specops.serviceAccountName" . }}
  automountServiceAccountToken: {{ .Values.serviceAccount.automountToken }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml .Values.podSecurityContext | nindent 4 }}
  containers:
    - name: models-fill
      {{- if eq $f.mode "bootstrap" }}
      image: {{ include "specops.image" (dict "ctx" . "repository" $f.bootstrap.image.repository "tag" $f.bootstrap.image.tag) | quote }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      # `specops bootstrap` (keeps a complete bootstrap of the same kind; writes a sibling temporary directory,
      # renamed into place, then copies the router's embedder), then `specops models check --mark`: the checks
      # serving runs at load, and ready.json, the marker the pods wait for, written last. sh runs the two under
      # the image's tini; "$@" is the bootstrap's arguments, as they follow.
      args:
        - sh
        - -c
        - 'specops bootstrap "$@" && exec specops models check --mark {{ if not $f.embedder }}--no-embedder {{ end }}"$MODELS_OUT"'
        - models-fill
        - --out
        - {{ $out | quote }}
        {{- if $f.force }}
        - --force
        {{- end }}
        {{- range $f.bootstrap.args }}
        - {{ . | quote }}
        {{- end }}
      {{- else }}
      image: {{ include "specops.image" (dict "ctx" . "repository" .Values.image.trainerRepository) | quote }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      args:
        - python
        - -c
        - |
          {{- .Files.Get "files/fill_models_s3.py" | nindent 10 }}
      {{- end }}
      env:
        - name: HOME
          value: /tmp
        - name: SPECOPS_DATA_DIR
          value: /data
        - name: HF_HUB_OFFLINE
          value: "1"
        - name: MODELS_OUT
          value: {{ $out | quote }}
        {{- if eq $f.mode "s3" }}
        - name: MODELS_S3_URI
          value: {{ $f.s3.uri | quote }}
        - name: MODELS_EMBEDDER
          value: {{ ternary "true" "false" $f.embedder | quote }}
        - name: MODELS_FORCE
          value: {{ ternary "true" "false" $f.force | quote }}
        - name: MODELS_S3_ENDPOINT
          value: {{ default .Values.s3.endpoint $f.s3.endpoint | quote }}
        - name: MODELS_S3_REGION
          value: {{ default .Values.s3.region $f.s3.region | quote }}
        {{- if $s3Secret }}
        - name: AWS_ACCESS_KEY_ID
          valueFrom:
            secretKeyRef:
              name: {{ $s3Secret }}
              key: {{ $s3IdKey }}
        - name: AWS_SECRET_ACCESS_KEY
          valueFrom:
            secretKeyRef:
              name: {{ $s3Secret }}
              key: {{ $s3KeyKey }}
        {{- end }}
        {{- end }}
        {{- with .Values.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      resources:
        {{- include "specops.resources" (dict "resources" $f.resources "gpus" $f.gpus "ctx" .) | nindent 8 }}
      securityContext:
        {{- toYaml .Values.securityContext | nindent 8 }}
      volumeMounts:
        - name: models
          mountPath: /models
        - name: data
          mountPath: /data
        - name: tmp
          mountPath: /tmp
        {{- with .Values.jobs.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: models
      persistentVolumeClaim:
        claimName: {{ include "specops.modelsClaim" . }}
    - name: data
      emptyDir: {}
    - name: tmp
      emptyDir: {}
    {{- with .Values.jobs.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with include "specops.podScheduling" .Values.jobs }}
  {{- . | trim | nindent 2 }}
  {{- end }}
{{- end }}
