//! The event catalogue's tenant service: thin over `app::catalogue`.

use relay_contracts::relay::tenant::v1::{self as pb, event_type_service_server::EventTypeService};
use relay_domain::catalogue::EventType;
use tonic::{Request, Response, Status};

use super::{status, tenant::TenantApi, ts};
use crate::{
    app::catalogue::{EventTypeChange, EventTypeFields},
    auth,
};

fn event_type(t: EventType) -> pb::EventType {
    pb::EventType {
        name: t.name,
        description: t.description,
        schema: t.schema.unwrap_or_default(),
        examples: t.examples,
        deprecated: t.deprecated,
        created_at: Some(ts(t.created_at)),
        updated_at: Some(ts(t.updated_at)),
        revision: t.revision as u64,
    }
}

#[tonic::async_trait]
impl EventTypeService for TenantApi {
    async fn create_event_type(&self, req: Request<pb::CreateEventTypeRequest>) -> Result<Response<pb::CreateEventTypeResponse>, Status> {
        let tenant = auth::tenant(&self.app, &req).await?;
        let r = req.into_inner();
        let fields = EventTypeFields { description: &r.description, schema: &r.schema, examples: &r.examples, deprecated: r.deprecated };
        let t = self.app.create_event_type(tenant, &r.name, fields).await.map_err(status)?;
        Ok(Response::new(pb::CreateEventTypeResponse { event_type: Some(event_type(t)) }))
    }

    async fn list_event_types(&self, req: Request<pb::ListEventTypesRequest>) -> Result<Response<pb::ListEventTypesResponse>, Status> {
        let tenant = auth::tenant(&self.app, &req).await?;
        let list = self.app.list_event_types(tenant).await.map_err(status)?;
        Ok(Response::new(pb::ListEventTypesResponse { event_types: list.into_iter().map(event_type).collect() }))
    }

    async fn get_event_type(&self, req: Request<pb::GetEventTypeRequest>) -> Result<Response<pb::GetEventTypeResponse>, Status> {
        let tenant = auth::tenant(&self.app, &req).await?;
        let t = self.app.get_event_type(tenant, &req.get_ref().name).await.map_err(status)?;
        Ok(Response::new(pb::GetEventTypeResponse { event_type: Some(event_type(t)) }))
    }

    async fn update_event_type(&self, req: Request<pb::UpdateEventTypeRequest>) -> Result<Response<pb::UpdateEventTypeResponse>, Status> {
        let tenant = auth::tenant(&self.app, &req).await?;
        let r = req.into_inner();
        let change = EventTypeChange {
            description: r.description.as_deref(),
            schema: &r.schema,
            clear_schema: r.clear_schema,
            examples: &r.examples,
            deprecated: r.deprecated,
        };
        let t = self.app.update_event_type(tenant, &r.name, change).await.map_err(status)?;
        Ok(Response::new(pb::UpdateEventTypeResponse { event_type: Some(event_type(t)) }))
    }

    async fn delete_event_type(&self, req: Request<pb::DeleteEventTypeRequest>) -> Result<Response<pb::DeleteEventTypeResponse>, Status> {
        let tenant = auth::tenant(&self.app, &req).await?;
        self.app.delete_event_type(tenant, &req.get_ref().name).await.map_err(status)?;
        Ok(Response::new(pb::DeleteEventTypeResponse {}))
    }

    async fn get_catalogue_settings(
        &self,
        req: Request<pb::GetCatalogueSettingsRequest>,
    ) -> Result<Response<pb::GetCatalogueSettingsResponse>, Status> {
        let tenant = auth::tenant(&self.app, &req).await?;
        let require = self.app.require_known_event_types(tenant).await.map_err(status)?;
        Ok(Response::new(pb::GetCatalogueSettingsResponse { settings: Some(pb::CatalogueSettings { require_known_event_types: require }) }))
    }

    async fn update_catalogue_settings(
        &self,
        req: Request<pb::UpdateCatalogueSettingsRequest>,
    ) -> Result<Response<pb::UpdateCatalogueSettingsResponse>, Status> {
        let tenant = auth::tenant(&self.app, &req).await?;
        let require = self.app.set_require_known_event_types(tenant, req.get_ref().require_known_event_types).await.map_err(status)?;
        Ok(Response::new(pb::UpdateCatalogueSettingsResponse {
            settings: Some(pb::CatalogueSettings { require_known_event_types: require }),
        }))
    }
}
